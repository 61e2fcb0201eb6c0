"""The engine loop: one thread owns the device and runs the pool's rounds (batch.BatchRun's halves).

The front end never touches the pool: it hands jobs (one sequence each) and cancellations to an
inbox, and receives each job's tokens through the job's sink, a thread-safe callback. Between two
rounds the loop takes in what arrived, so a new request waits at most one round (a prefill chunk
and a decode step, or a block of at most decode_block greedy steps) before it is scheduled, and a
cancelled one gives its slot back at the next round. A round prefills up to prefill_budget prompt
rows (whole chunks): prompts that arrive together get their first tokens in fewer rounds. The
pool's slots and length are fixed when the loop starts, so its graphs compile once.

Admission is bounded: a request is refused (Overloaded) when the sequences already taken in
(waiting, in the inbox, or holding a slot) leave no room for its own among slots + max_queue.
"""
from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import traceback
from typing import Callable

import jax

from .. import batch
from ..scheduler import Sequence


class Overloaded(Exception):
    """No room: every slot is taken and the queue is full."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new work."""


@dataclasses.dataclass(eq=False)
class Job:
    """One sequence of a request, and where its events go: sink(event) is called on the engine
    thread and must only hand the event over (an asyncio loop's call_soon_threadsafe).

    Events: ("prompt", job) once the prompt logprobs are in (when asked); ("tokens", job, ids,
    logprobs, tops) as tokens come; ("done", job, finish_reason) at the end; ("error", job,
    message, HTTP status) when the engine fails or stops before the sequence ends."""
    seq: Sequence
    choice: int
    sink: Callable
    sent: int = 0
    prompt_sent: bool = False


class EngineLoop:
    def __init__(self, engine, *, max_batch: int, max_queue: int, chunk: int, max_logprobs: int, max_stop_ids: int,
                 prefill_budget: int | None = None):
        self.engine = engine
        self._pool_args = dict(max_batch=max_batch, length=engine.cfg.max_context,
                               chunk=min(chunk, engine.cfg.max_context), logprobs=max_logprobs,
                               prefill_budget=prefill_budget,
                               stop_width=len(engine.eos_ids) + max_stop_ids, what="the server")
        with engine.exclusive():
            self.run = batch.open_run(engine, **self._pool_args)
        self.slots, self.length, self.chunk = self.run.slots, self.run.length, self.run.chunk
        self.capacity = self.run.slots + max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._taken = 0          # sequences admitted and not yet ended: the bound's count
        self._stopping = False
        self._stopped_why = "the server is shutting down"
        self._jobs: dict[int, Job] = {}  # engine thread only: id(seq) -> job
        self._next_index = 0
        self.stats = {"rounds": 0, "generated_tokens": 0, "finished": 0, "cancelled": 0, "failed_rounds": 0}
        self._snapshot = {"free_slots": self.run.slots, "running": 0, "waiting": 0, "state_copies": 0}
        self._thread = threading.Thread(target=self._main, name="baro-engine-loop", daemon=True)

    def warm_up(self, on_graph=None, threads: int | None = None) -> tuple[int, float]:
        """Compile the pool's step graphs before the loop starts (BatchRun.warm_up; threads: its
        compile threads, default the host's cores)."""
        if self._thread.is_alive():
            raise RuntimeError("warm_up runs before the engine loop starts")
        with self.engine.exclusive():
            return self.run.warm_up(on_graph=on_graph, threads=threads)

    # --- called from the front end's threads -----------------------------------------------
    def start(self):
        self._thread.start()

    def new_sequence(self, **fields) -> Sequence:
        """A Sequence with the next arrival index (the scheduler prefills the oldest first)."""
        with self._lock:
            i, self._next_index = self._next_index, self._next_index + 1
        return Sequence(index=i, **fields)

    def submit(self, jobs: list[Job]):
        """Take the jobs in, all or none (Overloaded, ShuttingDown)."""
        with self._lock:
            if self._stopping:
                raise ShuttingDown(self._stopped_why)
            if self._taken + len(jobs) > self.capacity:
                raise Overloaded(f"all {self.slots} sequence slots are busy and the queue is full "
                                 f"({self.capacity - self.slots} waiting at most); retry shortly")
            self._taken += len(jobs)
        self._inbox.put(("add", jobs))

    def cancel(self, jobs: list[Job]):
        """End the jobs at the next round (those already ended are left alone)."""
        self._inbox.put(("cancel", jobs))

    def health(self) -> dict:
        with self._lock:
            snap = dict(self._snapshot)
            taken = self._taken
        return {"slots": self.slots, "free_slots": snap["free_slots"], "running": snap["running"],
                "waiting": max(taken - snap["running"], 0), "queue_limit": self.capacity - self.slots,
                "max_context": self.length, "alive": self._thread.is_alive(),
                # prompt prefixes copied from another sequence's state instead of prefilled (n
                # samples, shared headers) in this pool
                "state_copies": snap["state_copies"], **self.stats}

    def stop(self, timeout: float | None = None):
        """Refuse new work, end what runs (its clients get an error event) and join the thread."""
        with self._lock:
            self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------
    def _main(self):
        while True:
            # idle: sleep until something arrives; busy: take what is there and go on
            msgs = [self._inbox.get()] if self.run.done and not self._jobs else []
            msgs += self._drain_inbox()
            stop = False
            for kind, jobs in msgs:
                if kind == "stop":
                    stop = True
                elif kind == "add":
                    for job in jobs:
                        self._add(job)
                else:
                    for job in jobs:
                        if id(job.seq) in self._jobs and self.run.cancel(job.seq):
                            self.stats["cancelled"] += 1
            if stop:
                self._fail_all("the server is shutting down", 503)
                return
            try:
                # a new sequence's first token goes out before the decode half (up to a block of
                # greedy steps) runs: time to first token is a prefill's, not a prefill's and a block's
                for half in (self.run.prefill_half, self.run.decode_half):
                    with self.engine.exclusive():
                        half()
                    self._publish()
                self.run.sched.drain_finished()
            except Exception as e:  # a device or engine failure: fail what runs, start a fresh pool
                traceback.print_exc(file=sys.stderr)
                self.stats["failed_rounds"] += 1
                self._fail_all(f"internal error in the engine: {type(e).__name__}: {e}", 500, inbox=False)
                if not self._reopen():
                    return
                continue
            self.stats["rounds"] += 1

    def _reopen(self) -> bool:
        """A fresh pool after a failed round; the failed one's buffers are freed first (a pool is
        sized to the device budget, so two at once need not fit). When none can be made, the
        loop stops: what waits and every later request get a 503 saying why (the thread would
        otherwise die and leave the inbox unread)."""
        try:
            with self.engine.exclusive():
                for x in jax.tree_util.tree_leaves(self.run.pool):
                    x.delete()
                self.run = batch.open_run(self.engine, **self._pool_args)
            return True
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            why = (f"the engine loop stopped: no fresh sequence pool after a failed round "
                   f"({type(e).__name__}: {e}); restart the server")
            with self._lock:
                self._stopping, self._stopped_why = True, why
            self._fail_all(why, 503)
            return False

    def _add(self, job: Job):
        try:
            self.run.add(job.seq)
        except (ValueError, TypeError) as e:  # the front end checks first; this is the pool's own word
            self._end(job, ("error", job, str(e), 400))
            return
        self._jobs[id(job.seq)] = job

    def _publish(self):
        """Hand each job what is new since the last round; forget the ended ones. The health
        snapshot is taken first, so a client that has its answer sees its slot free."""
        self._snap()
        for job in list(self._jobs.values()):
            seq = job.seq
            if (not job.prompt_sent and seq.want_prompt_logprobs and seq.prompt_logprobs is not None
                    and seq.prefilled == len(seq.prompt_ids)):
                job.prompt_sent = True
                _send(job, ("prompt", job))
            n = len(seq.generated)
            if n > job.sent:
                lo, job.sent = job.sent, n
                self.stats["generated_tokens"] += n - lo
                tops = seq.top_logprobs[lo:n] if seq.top_logprobs else None
                _send(job, ("tokens", job, seq.generated[lo:n], seq.logprobs[lo:n], tops))
            if seq.finish_reason is not None:
                self.stats["finished"] += 1
                self._end(job, ("done", job, seq.finish_reason))

    def _snap(self):
        sched = self.run.sched
        with self._lock:
            self._snapshot = {"free_slots": len(sched.free), "running": len(sched.running),
                              "waiting": len(sched.waiting), "state_copies": self.run.steps["forks"]}

    def _end(self, job: Job, event):
        self._jobs.pop(id(job.seq), None)
        with self._lock:
            self._taken -= 1
        _send(job, event)

    def _fail_all(self, message: str, status: int, inbox: bool = True):
        """End every job in the pool with the error; with inbox, also those not yet taken in (the
        loop is stopping). A failed round leaves them: they go to the fresh pool, or get the
        stopped loop's 503, never the failed round's error, whatever the thread's timing."""
        for job in list(self._jobs.values()):
            self.run.cancel(job.seq)
            self._end(job, ("error", job, message, status))
        for kind, jobs in self._drain_inbox() if inbox else ():
            if kind == "add":
                for job in jobs:
                    self._end(job, ("error", job, message, status))
        self.run.sched.drain_finished()
        self._snap()

    def _drain_inbox(self):
        out = []
        try:
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            return out


def _send(job: Job, event):
    try:
        job.sink(event)
    except RuntimeError:  # the client's event loop is gone (the server is stopping)
        pass
