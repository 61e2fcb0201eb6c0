"""Many sequences at once: the graphs of a batch step and the loop that runs the scheduler.

Each step is one of three graphs, whose shapes depend on the slot count, the pool's length and
the prefill chunk, never on a prompt's length (no compilation per request):
- a prefill chunk of one sequence: its slot's state taken out of the pool (its KV pages gathered
  into the contiguous one-sequence cache), the one-sequence forward (model.forward, the same graph
  as a prefill alone) over `chunk` rows, put back (scattered into its pages);
- a decode step of every slot (model.decode_rows): one row per sequence, idle slots' rows
  discarded;
- both in one pass (model.mixed_forward), when a round has a chunk to prefill and sequences to
  decode: the chunk's rows and the decode rows share every GEMM and the MoE, so each weight is read
  once for both.
Tier mode runs the three from its Python layer loops (tier_prefill, tier_decode, tier_mixed: the
slot's state through the staged forward; staging.decode_rows), one decode step per call.
BatchRun.step() runs one round (admit, a prefill chunk, a decode step or block); sequences may be
added and cancelled between rounds, which is how a server keeps one pool running.
All compute each row exactly as the sequence alone would (the kernels are row-invariant, the
conv and delta rows fold into one row of more channels, attention reads each row's own slot),
so generate_batch gives every sequence the bytes of generate() alone, which equal its replay.
Logprobs are log_softmax rows of the same logits (an ordered row-wise op).
"""
from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
import jax
import jax.numpy as jnp

from . import budget, checks
from . import model as M
from . import pool as Pool
from .block_manager import BlockManager, pages_for, positions_of
from .logprobs import row_logprobs
from .ops_xla import KV_BLOCK
from .results import GenerateResult, check_logprobs
from .runner import to_device
from .sampling import SAMPLE_ROWS, SEED_RANGE, Sampling, draw_row, k_max_for, ranks_needed, row_params, sample_rows
from .scheduler import Scheduler, Sequence
from .settings import DEFAULT_KV_PAGE
from .shapes import state_length


def _prefill(params, pool, table, slot, tokens, pos, n_valid, rope, *, cfg, ops, all_logits: bool):
    st = Pool.slot_state(pool, table, slot)
    logits, st = M.forward(params, st, tokens, pos, n_valid, rope, cfg=cfg, ops=ops, all_logits=all_logits)
    return logits, Pool.put_slot_state(pool, table, slot, st)


def _decode(params, pool, table, tokens, running, pos, rope, *, cfg, ops, guard: bool, top_n):
    """One decode step of the pool's first k slots, k = len(tokens) (the slots up to the highest
    one in use, rounded up to a bucket; table is the table's first k rows): (logits [k, V],
    logprob rows [k, V], the greedy ids [k], their logprobs [k] and the top_n (ids, values) of
    every row, the pool). The slots past k are not touched. guard: keep the state of the slots
    that do not run (one holds a prompt half prefilled); without it their conv and delta rows are
    left as the step wrote them (free or finished slots, cleared before a new sequence takes them)."""
    k = tokens.shape[0]
    out = _decode_prefix(params, Pool.prefix(pool, k), table, tokens, running, pos, rope, cfg=cfg, ops=ops, guard=guard,
                         top_n=top_n)
    return out[:-1] + (Pool.put_prefix(pool, out[-1], k),)


def _decode_prefix(params, sub, table, tokens, running, pos, rope, *, cfg, ops, guard: bool, top_n):
    """_decode on a pool of exactly len(tokens) slots."""
    logits, new = M.decode_rows(params, sub, table, tokens, _row_slots(running), pos, rope, cfg=cfg, ops=ops)
    sub = Pool.keep_running(sub, new, running) if guard else new
    return _rows_out(logits, ops=ops, top_n=top_n) + (sub,)


def _mixed(params, pool, table, slot, tokens, pos, n_valid, row_tokens, running, row_pos, rope, *, cfg, ops,
           all_logits: bool, guard: bool, top_n):
    """_prefill of slot `slot` and _decode of the pool's first k = len(row_tokens) slots in one pass
    (model.mixed_forward: one read of every weight for both). table is the whole page table (the
    chunk's slot may lie past k). Returns (the chunk's logits, then _decode's outputs). The chunk's
    slot runs no decode row (it is not running): its state is the chunk's, put back last."""
    k = row_tokens.shape[0]
    st = Pool.slot_state(pool, table, slot)
    sub = Pool.prefix(pool, k)
    logits, rows, st, new = M.mixed_forward(params, st, tokens, pos, n_valid, sub, table[:k], row_tokens,
                                            _row_slots(running), row_pos, rope, cfg=cfg, ops=ops,
                                            all_logits=all_logits)
    sub = Pool.keep_running(sub, new, running) if guard else new
    pool = Pool.put_slot_state(Pool.put_prefix(pool, sub, k), table, slot, st)
    return (logits,) + _rows_out(rows, ops=ops, top_n=top_n) + (pool,)


def _row_slots(running):
    """decode_rows' slots: row r reads and writes slot r when it runs, nothing (-1) when idle."""
    return jnp.where(running, jnp.arange(running.shape[0], dtype=jnp.int32), -1)


def _rows_out(logits, *, ops, top_n):
    """A decode step's logits [P, V] -> (logits, logprob rows, the greedy ids, their logprobs, the
    top_n (ids, values) of every row); None for what is not asked."""
    ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # greedy's rule: ties to the lower id
    lp = None if top_n is None else row_logprobs(ops, logits)
    return (logits, lp) + _picked(lp, ids, top_n)


def _picked(lp, ids, top_n):
    """(ids, the logprob of each row's id, top_n ids, top_n values) from the logprob rows lp;
    None for what is not asked."""
    if top_n is None:
        return ids, None, None, None
    chosen = jnp.take_along_axis(lp, ids[:, None], axis=1)[:, 0]
    if not top_n:
        return ids, chosen, None, None
    vals, top = jax.lax.top_k(lp, top_n)  # ties to the lower id, as np.argsort(-lp, kind="stable")
    return ids, chosen, top.astype(jnp.int32), vals


def _decode_block(params, pool, table, tokens, running, pos, left, stops, rope, n=None, samp=None, *, cfg, ops,
                  guard: bool, top_n, block: int, k_max=None):
    """Up to `block` greedy decode steps of every slot in one graph (n of them when given, a
    traced count, so one graph serves every shorter block). A row stops on the device when its
    id is in its row of `stops` [P, W] (its end and stop ids, -1 padded) or when `left` (tokens it may still make)
    reaches 0; a stopped row runs no more steps, so its state (with guard) and position stay
    where its sequence ended. Returns (ids [block, P] (-1 where a row did not run), their
    logprobs, top ids, top values (None when not asked), the pool, and (tokens, running, pos,
    left) after the block: the next block's inputs, so that it can be queued before this one's
    ids are read). samp (with k_max, sample_rows'): the rows' (temperature, top_k, top_p, key data,
    index of the block's first token) where some row is sampled; a row draws its i-th token of
    the block with index + i, so its ids are those it draws alone."""
    P = tokens.shape[0]  # the pool's first P slots (as _decode)

    def body(i, carry):
        pool, tok, run, pos, left, out = carry
        logits, rows, ids, lp, top, vals, pool = _decode_prefix(params, pool, table, tok, run, pos, rope, cfg=cfg,
                                                                ops=ops, guard=guard, top_n=top_n)
        if samp is not None:
            temperature, top_k, top_p, keys, index = samp
            ids = sample_rows(logits, temperature, top_k, top_p, keys, index + i, k_max=k_max)
            ids, lp, top, vals = _picked(rows, ids, top_n)
        ids = jnp.where(run, ids, -1)
        out = tuple(o if o is None else o.at[i].set(x) for o, x in zip(out, (ids, lp, top, vals)))
        left = left - run.astype(jnp.int32)
        go = run & (left > 0) & ~jnp.any(ids[:, None] == stops, axis=1)
        return pool, jnp.where(run, ids, tok), go, pos + run.astype(jnp.int32), left, out

    out = (jnp.full((block, P), -1, jnp.int32),
           None if top_n is None else jnp.zeros((block, P), jnp.float32),
           None if not top_n else jnp.zeros((block, P, top_n), jnp.int32),
           None if not top_n else jnp.zeros((block, P, top_n), jnp.float32))
    steps = block if n is None else n
    sub, tok, run, pos, left, out = jax.lax.fori_loop(0, steps, body, (Pool.prefix(pool, P), tokens, running, pos, left,
                                                                       out))
    return out + (Pool.put_prefix(pool, sub, P), (tok, run, pos, left))


PREFILL = jax.jit(_prefill, static_argnames=("cfg", "ops", "all_logits"), donate_argnums=(1,))
DECODE = jax.jit(_decode, static_argnames=("cfg", "ops", "guard", "top_n"), donate_argnums=(1,))
MIXED = jax.jit(_mixed, static_argnames=("cfg", "ops", "all_logits", "guard", "top_n"), donate_argnums=(1,))
DECODE_BLOCK = jax.jit(_decode_block, static_argnames=("cfg", "ops", "guard", "top_n", "block", "k_max"),
                       donate_argnums=(1,))
CLEAR = jax.jit(Pool.clear_slot, donate_argnums=(0,))
MOVE = jax.jit(Pool.move_slot, donate_argnums=(0,))  # (pool, src, dst)
FORK = jax.jit(Pool.fork_slot, donate_argnums=(0,))  # (pool, src, dst, src_pages, dst_pages)
TAKE = jax.jit(Pool.slot_state)  # (pool, table, slot)
PUT = jax.jit(Pool.put_slot_state, donate_argnums=(0,))  # (pool, table, slot, state)
ROWS_OUT = jax.jit(_rows_out, static_argnames=("ops", "top_n"))
ROW_SLOTS = jax.jit(_row_slots)
LOGPROBS = jax.jit(lambda logits, ops: row_logprobs(ops, logits), static_argnames=("ops",))
TOP = jax.jit(lambda lp, k: jax.lax.top_k(lp, k), static_argnames=("k",))  # ties to the lower id
PICK = jax.jit(lambda lp, rows, ids: lp[rows, ids])  # the logprobs of host-chosen ids


def compile_threads(threads: int | None = None) -> int:
    """The host threads BatchRun.warm_up compiles on: threads, or by default the host's cores, at most 16."""
    return min(16, os.cpu_count() or 1) if threads is None else threads


# Tier mode's steps (routed experts in host memory): the same contracts as PREFILL and DECODE, run
# by the runner's Python layer loops (staging.py), which stage the experts layer by layer.
def tier_prefill(runner):
    """PREFILL in tier mode: the slot's state out of the pool, the runner's own forward over the
    chunk (generate()'s prefill, so its bytes), the state back in."""
    def prefill(params, pool, table, slot, tokens, pos, n_valid, rope, *, cfg, ops, all_logits: bool):
        logits, st = runner.forward(TAKE(pool, table, slot), tokens, pos, n_valid, all_logits=all_logits)
        return logits, PUT(pool, table, slot, st)

    return prefill


# tier mode's put_prefix layer by layer, in place (its layer loop donated the pool's KV pages,
# so a jitted put_prefix of the whole pool could not take them)
PUT_LAYER_PREFIX = jax.jit(Pool.put_layer_prefix, donate_argnums=(0,))


def tier_decode(runner):
    """DECODE in tier mode: the runner's per-layer rows (TierRunner.decode_rows) over the pool's
    first k = len(tokens) slots, then the same ids, logprobs and top rows."""
    def decode(params, pool, table, tokens, running, pos, rope, *, cfg, ops, guard: bool, top_n):
        k = tokens.shape[0]
        logits, sub = runner.decode_rows(Pool.prefix(pool, k), table, tokens, ROW_SLOTS(running), running, pos,
                                         ops=ops, guard=guard)
        return ROWS_OUT(logits, ops=ops, top_n=top_n) + (Pool.put_prefix(pool, sub, k, PUT_LAYER_PREFIX),)

    return decode


def tier_mixed(runner):
    """MIXED in tier mode: the slot's state out of the pool, the runner's staged pass over the
    chunk and the decode rows of the pool's first k = len(row_tokens) slots (TierRunner.mixed),
    the state back in."""
    def mixed(params, pool, table, slot, tokens, pos, n_valid, row_tokens, running, row_pos, rope, *, cfg, ops,
              all_logits: bool, guard: bool, top_n):
        k = row_tokens.shape[0]
        st = TAKE(pool, table, slot)
        logits, rows, st, sub = runner.mixed(st, tokens, pos, n_valid, Pool.prefix(pool, k), table[:k], row_tokens,
                                             ROW_SLOTS(running), running, row_pos, ops=ops, guard=guard,
                                             all_logits=all_logits)
        pool = Pool.put_prefix(pool, sub, k, PUT_LAYER_PREFIX)
        return (logits,) + ROWS_OUT(rows, ops=ops, top_n=top_n) + (PUT(pool, table, slot, st),)

    return mixed


def rows_attention_fallback(base_attention):
    """attention_rows through the one-sequence kernel, one row at a time on the contiguous cache
    its slot's pages stand for (the m = 1 decode call itself, so its bytes), scattered back into
    the pages: for backends without the pooled kernel."""
    def attention_rows(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, table, slots, pos, *, num_heads,
                       num_kv_heads, eps):
        outs = []
        for r in range(qkv.shape[0]):
            live = slots[r] >= 0
            row = jnp.where(live, table[jnp.maximum(slots[r], 0)], -1)  # a padding row's cache goes nowhere
            at = jnp.where(live, pos[r], 0)  # a padding row's position may be anything
            o, k, v = base_attention(qkv[r:r + 1], q_norm, k_norm, cos[r:r + 1], sin[r:r + 1],
                                     Pool.gather_cache(k_pages, row), Pool.gather_cache(v_pages, row), at,
                                     jnp.int32(1), num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
            k_pages = Pool.scatter_cache(k_pages, row, k)
            v_pages = Pool.scatter_cache(v_pages, row, v)
            outs.append(jnp.where(live, o, jnp.zeros_like(o)))
        return jnp.concatenate(outs), k_pages, v_pages

    return attention_rows


class PooledOps:
    """An ops object with attention_rows (the backend's, or the fallback above); hashable like the
    ops it wraps, so jit keys graphs on it."""

    def __init__(self, base):
        self._base = base
        self.attention_rows = getattr(base, "attention_rows", None) or rows_attention_fallback(base.attention)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._base, name)

    def __hash__(self):
        return hash(("pooled", self._base))

    def __eq__(self, other):
        return isinstance(other, PooledOps) and other._base is self._base


_POOLED: dict = {}


def pooled_ops(ops):
    if id(ops) not in _POOLED:
        _POOLED[id(ops)] = (ops, PooledOps(ops))
    return _POOLED[id(ops)][1]


def choose(logits_row, seq: Sequence) -> int:
    """The sequence's next token from its logits row [V] (sampling.draw_row with the token's index:
    the rule Engine.generate draws by)."""
    return int(draw_row(logits_row, seq.sampling, len(seq.generated)))


class BatchRun:
    """A pool of sequence slots, the scheduler, and the rounds of steps over them: one
    generate_batch call, or a server's pool that sequences join and leave while it runs.

    logprobs: None (none), 0 (each chosen token's) or k (also the k most likely, for every
    sequence: a caller wanting fewer takes a prefix). stop_width: end and stop ids a row may carry
    to the device (None: the most any of `sequences` has); a graph is compiled per width.
    prefill_budget: prompt rows a round may prefill, in whole chunks (None: one chunk; a prompt's
    last, partial chunk counts as a whole one: its graph runs `chunk` rows all the same). More
    shortens the wait for a first token when many prompts arrive together, at the price of a
    longer gap between the running sequences' tokens in those rounds; a prompt's chunks are
    the same either way, so no sequence's bytes change. pages: KV pages of `page` positions the
    slots share (None: enough for every slot at `length`); a sequence is admitted with the pages of
    its prompt and max_new_tokens, and waits while too few are free."""

    def __init__(self, runner, tokenizer, sequences: list[Sequence], *, slots: int, length: int, chunk: int,
                 logprobs: int | None, keep_states: bool, on_token=None, block: int = 1, stop_width: int | None = None,
                 chain: bool = True, prefill_budget: int | None = None, pages: int | None = None,
                 page: int = DEFAULT_KV_PAGE, mixed: bool | None = None, share_prefixes: bool = True):
        self.r, self.tok = runner, tokenizer
        # chain: greedy blocks run one ahead while nothing waits for a slot (the next block queued
        # from the last one's outputs before its ids are read), so the device does not idle while
        # the host reads a block; a server turns it off to take new requests between blocks
        self.chain = chain
        self.cfg, self.ops = runner.cfg, pooled_ops(runner.ops)
        self.slots, self.length, self.chunk = slots, length, chunk
        # at least one chunk a round, or prompts would never be prefilled
        self.prefill_budget = chunk if prefill_budget is None else checks.as_int("prefill_budget", prefill_budget,
                                                                                   lo=1)
        self.top_n, self.keep_states = logprobs, keep_states
        self.on_token = on_token
        # tier mode stages experts from Python per layer and step: no device loop over steps
        tier = runner.placement == "tier"
        self.block = 1 if tier else block
        self._prefill_step = tier_prefill(runner) if tier else PREFILL
        self._decode_rows_step = tier_decode(runner) if tier else DECODE
        self._mixed_pass = tier_mixed(runner) if tier else MIXED
        # mixed: a round's first prefill chunk and its decode step run as one pass (MIXED; in tier
        # mode its layer loop, each layer staged once for both), every weight read once for both
        # (None: the runner's settings.mixed_rounds)
        self._mixed = None if mixed is None else bool(mixed)
        self._decoded = False  # this round's decode step ran with its first chunk
        # a page holds whole KV blocks of the attention kernels, which refuse any other size
        page = checks.as_int("page", page)
        if page < 1 or page % KV_BLOCK:
            raise ValueError(f"page must be a positive multiple of {KV_BLOCK} positions (a page holds whole "
                             f"KV blocks of the attention kernels), got {page}")
        # a slot's table row maps whole pages: its cache is `length` rounded up to a page
        per_slot = -(-length // page)
        self.pages = slots * per_slot if pages is None else checks.as_int("pages", pages, lo=1)
        self.blocks = BlockManager(slots, self.pages, page, per_slot * page)
        self.sched = Scheduler(slots, self.blocks)
        self.pool = Pool.init_pool(self.cfg, runner.dtype, slots, self.pages, page)
        self._tables: dict = {}  # rows asked -> (the table's version, its first rows on the device)
        # decode_rows: rows the decode steps computed (a step runs the slots up to the highest one
        # decoding, rounded up to a power of two)
        # mixed: rounds whose first chunk and decode step ran as one pass (each also counted as a
        # prefill and a decode step); moves: sequences moved to a lower slot (_pack); forks:
        # sequences that took a copy of another's prompt state instead of prefilling their own
        self.steps = {"prefill": 0, "decode": 0, "decode_calls": 0, "chained_calls": 0, "decode_rows": 0, "mixed": 0,
                      "moves": 0, "forks": 0}
        self.t0 = time.perf_counter()
        self.stop_width = max([1] + [len(_device_stops(s)) for s in sequences]) if stop_width is None else stop_width
        # host-side stops (a callback, stop strings) end a sequence after the device has run on:
        # its tokens past the stop are dropped, but a kept state would have moved on
        self.host_stops = on_token is not None
        # share_prefixes: a sequence added without a fork_of whose prompt starts with the same chunk
        # of tokens as one in the pool copies that one's state where their prompts part (_link_prefix);
        # _heads: the sequence a chunk of first tokens leads to
        self.share_prefixes, self._heads = share_prefixes, {}
        for seq in sequences:
            self.add(seq)

    def add(self, seq: Sequence):
        """A sequence joins: it takes a slot at a later round, when one is free. It must be a new
        one (a Sequence added before, waiting, running or ended, is refused: queued twice it would
        hold two slots, one of them for ever) with a prompt of at least one token in the vocabulary."""
        if (seq.finish_reason is not None or seq.slot is not None or seq.prefilled or seq.generated
                or any(s is seq for s in self.sched.waiting)):
            raise ValueError(f"sequence {seq.index} was already added to a pool (give each request a new Sequence)")
        if not seq.prompt_ids:
            raise ValueError(f"sequence {seq.index}: the prompt is empty: give at least one token")
        seq.prompt_ids = checks.token_ids(seq.prompt_ids, self.cfg.vocab_size, f"sequence {seq.index}'s prompt ids")
        src = seq.fork_of
        if src is not None:
            if not (src.slot is not None or src.finish_reason is not None or any(s is src for s in self.sched.waiting)):
                raise ValueError(f"sequence {seq.index}: fork_of must name a sequence added to this pool before it "
                                 f"(sequence {src.index} was not)")
            f = checks.as_int("fork_at", seq.shared, lo=1, hi=len(seq.prompt_ids))
            if (src is seq or list(src.prompt_ids[:f]) != list(seq.prompt_ids[:f])
                    or src.want_prompt_logprobs != seq.want_prompt_logprobs or src.prompt_top_n != seq.prompt_top_n):
                raise ValueError(f"sequence {seq.index}: fork_of must name another sequence whose prompt starts with "
                                 f"the {f} shared tokens, with the same prompt logprob asks (sequence {src.index} "
                                 "differs)")
        checks.as_int("max_new_tokens", seq.max_new_tokens, lo=0)
        checks.as_int("prompt_top_n", seq.prompt_top_n, lo=0, hi=self.cfg.vocab_size)
        if len(_device_stops(seq)) > self.stop_width:
            raise ValueError(f"a sequence with {len(_device_stops(seq))} end and stop ids; this pool carries at "
                             f"most {self.stop_width} per sequence")
        if seq.positions > self.length:  # the last new token is never fed back
            raise ValueError(f"a sequence of {len(seq.prompt_ids)} prompt tokens and {seq.max_new_tokens} new "
                             f"ones does not fit a pool of {self.length} positions per slot")
        self.blocks.check_fits(seq.positions, f"a sequence of {len(seq.prompt_ids)} prompt tokens and "
                                              f"{seq.max_new_tokens} new ones")
        self.host_stops = self.host_stops or bool(seq.stop_strings)
        if src is None and self.share_prefixes:
            self._link_prefix(seq)
        self.sched.add(seq)

    def _link_prefix(self, seq: Sequence):
        """seq's fork_of: the sequence its first chunk of prompt tokens leads to, where that one is
        still to prefill past the tokens the two share (so their state can be copied), with fork_at
        where their prompts part; else seq leads that chunk from now on. A few-shot header or a
        system prompt is then prefilled once for the sequences that meet it in the pool."""
        if len(seq.prompt_ids) < self.chunk:
            return
        key = tuple(seq.prompt_ids[:self.chunk])
        src = self._heads.get(key)
        if src is not None and src.finish_reason is None:
            a, b = src.prompt_ids, seq.prompt_ids
            f = self.chunk
            while f < len(a) and f < len(b) and a[f] == b[f]:
                f += 1
            if src.prefilled < f and src.want_prompt_logprobs == seq.want_prompt_logprobs \
                    and src.prompt_top_n == seq.prompt_top_n:
                seq.fork_of, seq.fork_at = src, f
                return
        self._heads[key] = seq

    def row_buckets(self) -> list[int]:
        """Every row count a decode step of this pool may run (see _rows)."""
        return sorted({self._bucket(n) for n in range(1, self.slots + 1)})

    def warm_up(self, prompt_logprobs: bool = False, on_graph=None, sampled: bool = True,
                threads: int | None = None) -> tuple[int, float]:
        """Compile, before any sequence joins, every step graph the rounds may use: the prefill
        chunk, and at each row bucket the decode step, the block of steps (whole and shorter), and
        the chunk-and-step pass, with idle slots' states kept and not (prompt_logprobs: also the
        chunk graphs that return every row's logits; sampled: also the blocks and the step's draw
        at each ranking width: plain temperature, a top_k of at most K_DEVICE, the whole row
        ranked). Otherwise a round that first meets a bucket compiles it while every running
        sequence waits. The jitted graphs are first lowered and compiled side by side on `threads`
        host threads (default: the host's cores, at most 16; XLA compiles outside the GIL, and
        compiling was ~80% of a warm-up), then each runs once on idle rows and a free slot with no
        pages, which the admission of a sequence clears anyway.
        on_graph(done, total) reports progress. Returns (graphs run, seconds)."""
        if self.sched.running or self.sched.waiting:
            raise RuntimeError("warm_up runs on an empty pool, before sequences are added")
        t0 = time.perf_counter()
        jobs = self._warm_up_jobs(prompt_logprobs, sampled)
        report = on_graph or (lambda done, total: None)
        compiled = self._compile_side_by_side(jobs, threads, lambda done: report(done, len(jobs)))
        done = len(compiled)
        for i, (fn, args, pick) in enumerate(jobs):
            a, kw = args(self.pool)
            self.pool = pick(fn(*a, **kw))
            jax.block_until_ready(self.pool)
            if i not in compiled:  # the compiled ones were counted as they compiled
                done += 1
                report(done, len(jobs))
        return len(jobs), time.perf_counter() - t0

    def _warm_up_jobs(self, prompt_logprobs: bool, sampled: bool) -> list:
        """warm_up's graphs as (fn, args, pick): args(pool) -> fn's (positional, keyword) arguments,
        pick(fn's result) -> the pool after it."""
        p, rope, slot = self.r.params, self.r.rope, jnp.int32(0)
        toks = jnp.zeros((self.chunk,), jnp.int32)
        kw = dict(cfg=self.cfg, ops=self.ops)
        logits_kinds = (False, True) if prompt_logprobs else (False,)
        pool_itself = lambda out: out  # noqa: E731
        no_pages = jnp.asarray(self.blocks.table[0])  # slot 0 holds no pages yet
        jobs = [(CLEAR, lambda pool: ((pool, slot, no_pages), {}), pool_itself),
                (MOVE, lambda pool: ((pool, slot, slot), {}), pool_itself),
                (FORK, lambda pool: ((pool, slot, slot, no_pages, no_pages), {}), pool_itself)]
        for all_logits in logits_kinds:
            jobs.append((self._prefill_step, lambda pool, a=all_logits: (
                (p, pool, self.table(), slot, toks, jnp.int32(0), jnp.int32(1), rope), dict(all_logits=a, **kw)),
                lambda out: out[1]))
        V = self.cfg.vocab_size
        rows_in = self._sampling_arrays([], self.slots)  # sample_rows' inputs, each bucket its first rows
        widths = sorted({ranks_needed(s, V) for s in (Sampling(1.0), Sampling(1.0, top_k=2), Sampling(1.0, top_p=0.5))})
        draws = [(None, None)] + ([(rows_in, w) for w in widths] if sampled else [])
        for k in self.row_buckets():
            rows = jnp.zeros((k,), jnp.int32)
            idle = jnp.zeros((k,), bool)
            for samp, k_max in draws[1:]:  # a step's draw over its rows (_step_done); the pool untouched
                logits = jnp.zeros((k, V), jnp.float32)
                jobs.append((SAMPLE_ROWS, lambda pool, k=k, samp=samp, k_max=k_max, logits=logits: (
                    (logits,) + tuple(x[:k] for x in samp), dict(k_max=k_max)), lambda out: self.pool))
            stops = jnp.full((k, self.stop_width), -1, jnp.int32)
            for guard in (False, True):
                step = dict(guard=guard, top_n=self.top_n, **kw)
                jobs.append((self._decode_rows_step, lambda pool, k=k, step=step, rows=rows, idle=idle: (
                    (p, pool, self.table(k), rows, idle, rows, rope), step), lambda out: out[-1]))
                if self.block > 1:
                    for n in (None, jnp.int32(1)):
                        for samp, k_max in draws:
                            jobs.append((DECODE_BLOCK, lambda pool, k=k, step=step, n=n, rows=rows, idle=idle,
                                         stops=stops, samp=samp, k_max=k_max: (
                                (p, pool, self.table(k), rows, idle, rows, rows, stops, rope, n,
                                 None if samp is None else tuple(x[:k] for x in samp)),
                                dict(block=self.block, k_max=k_max, **step)), lambda out: out[4]))
                if self.mixed:
                    for all_logits in logits_kinds:
                        jobs.append((self._mixed_pass, lambda pool, step=step, a=all_logits, rows=rows, idle=idle: (
                            (p, pool, self.table(), slot, toks, jnp.int32(0), jnp.int32(1), rows, idle, rows, rope),
                            dict(all_logits=a, **step)), lambda out: out[-1]))
        return jobs

    def _compile_side_by_side(self, jobs, threads: int | None, on_compiled) -> set:
        """Lower and compile the jitted graphs among jobs on several host threads, against the
        pool as it is (lowering reads shapes only: nothing is donated or run); on_compiled(n) after
        each. A compiled graph is the one the later call finds, so warm_up's calls then run without
        compiling. Tier mode's steps are Python layer loops of many small graphs: they compile as
        they run. Returns the indices of the jobs compiled here."""
        lowerable = [i for i, (fn, _, _) in enumerate(jobs) if hasattr(fn, "lower")]
        threads = compile_threads(threads)
        if threads < 2 or len(lowerable) < 2:
            return set()

        def compile_one(i):
            fn, args, _ = jobs[i]
            a, kw = args(self.pool)
            fn.lower(*a, **kw).compile()

        with ThreadPoolExecutor(max_workers=min(threads, len(lowerable))) as ex:
            for n, fut in enumerate(as_completed([ex.submit(compile_one, i) for i in lowerable]), 1):
                fut.result()  # the first failure is raised here, before any graph runs
                on_compiled(n)
        return set(lowerable)

    def cancel(self, seq: Sequence) -> bool:
        """End a sequence now (finish_reason "cancelled"); its slot is free for the next round."""
        self._drop_head(seq)
        return self.sched.cancel(seq)

    def _drop_head(self, seq: Sequence):
        """An ended sequence leads no chunk of first tokens (a long-running pool keeps none)."""
        key = tuple(seq.prompt_ids[:self.chunk])
        if self._heads.get(key) is seq:
            del self._heads[key]

    @property
    def done(self) -> bool:
        return self.sched.done

    def run(self) -> list[Sequence]:
        done = []
        while not self.sched.done:
            done += self.step()
        return sorted(done, key=lambda s: s.index)

    def step(self) -> list[Sequence]:
        """One round: waiting sequences into free slots, one prefill chunk, one decode step (or a
        block of greedy steps). Returns the sequences that finished since the last round."""
        self.prefill_half()
        self.decode_half()
        return self.sched.drain_finished()

    def prefill_half(self):
        """A round's first half: admit, then prefill chunks, oldest prompt first, until the round's
        prefill budget is spent (at least one chunk; a prompt that completes gets its first token
        here, which a server can send before the decode half runs)."""
        for seq in self.sched.admit():
            self.pool = CLEAR(self.pool, jnp.int32(seq.slot), jnp.asarray(self.blocks.table[seq.slot]))
        self._pack()
        spent = 0
        self._decoded = False
        while spent < self.prefill_budget:
            seq = self.sched.next_prefill()
            if seq is None:
                break
            decoding = self.sched.decoding() if self.mixed and not spent else []
            if decoding:  # the round's decode step rides with its first chunk
                self._mixed_step(seq, decoding)
                self._decoded = True
            else:
                self._prefill_chunk(seq)
            spent += self.chunk

    def _pack(self):
        """Close the holes that ended sequences left below the highest slot in use, when that lets
        the decode steps run a smaller row bucket: each move copies one slot's conv and delta
        state (its pages follow its table row), exact copies, so no bit changes."""
        running = self.sched.running
        if not running or self._bucket(max(running) + 1) <= self._bucket(len(running)):
            return
        for src, dst in self.sched.pack():
            self.pool = MOVE(self.pool, jnp.int32(src), jnp.int32(dst))
            self.steps["moves"] += 1

    def _bucket(self, n: int) -> int:
        """The row bucket of a step over slots 0 .. n-1: n rounded up to a power of two, at most the
        pool (tier mode too: its MoE then needs the experts of fewer rows, and a step of one row
        runs on the direct path)."""
        k = 1
        while k < n:
            k *= 2
        return min(k, self.slots)

    @property
    def mixed(self) -> bool:
        """Whether a round's first chunk and its decode step run as one pass (read every round, so
        that Engine.tune(mixed_rounds=...) reaches a running pool)."""
        return self.r.settings.mixed_rounds if self._mixed is None else self._mixed

    def decode_half(self):
        """A round's second half: one decode step of every running sequence, or a block of them
        (nothing when the step ran with the round's first chunk)."""
        if self._decoded:
            self._decoded = False
            return
        decoding = self.sched.decoding()
        if decoding:
            k = self._block_length(decoding)
            if k > 1:
                self._decode_block(decoding, k)
            else:
                self._decode_step(decoding)

    def _block_length(self, decoding) -> int:
        """Decode steps the next call may run on the device: one while a prompt is being prefilled
        (its chunks interleave with the steps) or a kept state meets stops checked here; else up to
        the block, no longer than the longest sequence has left, and while others wait for a slot
        no longer than the first to finish by length."""
        if self.block <= 1 or self.sched.next_prefill() is not None:
            return 1
        if self.keep_states and self.host_stops:
            return 1
        left = [s.max_new_tokens - len(s.generated) for s in decoding]
        return max(1, min(self.block, min(left) if self.sched.waiting else max(left)))

    def _rows(self, decoding) -> int:
        """Decode rows of the next step: the slots up to the highest one decoding, rounded up to
        a power of two (or the pool): one graph per bucket, and at low load a step computes a few
        rows instead of every slot's (new sequences take the lowest free slot, scheduler.py)."""
        return self._bucket(max(s.slot for s in decoding) + 1)

    def _chain_rows(self, decoding, unqueued, P: int):
        """The rows of a chain's next block: those of the sequences with tokens left to queue
        (the others' rows would not run), never more than the chain's rows so far."""
        live = [s for s in decoding if s.finish_reason is None and unqueued[s.slot] > 0]
        return min(P, self._rows(live)) if live else P

    def table(self, k: int | None = None):
        """The page table on the device (its first k rows), sent again only after admissions or
        finishes changed it or another k is asked."""
        k = self.slots if k is None else k
        version, rows = self._tables.get(k, (None, None))
        if version != self.blocks.version:
            rows = jnp.asarray(self.blocks.table[:k])
            self._tables[k] = (self.blocks.version, rows)
        return rows

    def _inputs(self, decoding, P: int):
        toks, pos, left = np.zeros((P,), np.int32), np.zeros((P,), np.int32), np.zeros((P,), np.int32)
        running = np.zeros((P,), bool)
        stops = np.full((P, self.stop_width), -1, np.int32)
        for seq in decoding:
            toks[seq.slot], pos[seq.slot], running[seq.slot] = seq.generated[-1], seq.pos, True
            left[seq.slot] = seq.max_new_tokens - len(seq.generated)
            ends = _device_stops(seq)
            stops[seq.slot, :len(ends)] = ends
        return toks, running, pos, left, stops

    def _guard(self, decoding) -> bool:
        """Whether idle slots' states must be kept through the decode rows (see _decode)."""
        return self.keep_states or len(decoding) < len(self.sched.running)

    # --- the two kinds of step ---------------------------------------------------------
    def _chunk_inputs(self, seq: Sequence):
        """The next prefill chunk of seq: (its start, its tokens, the chunk's rows padded). It ends
        early where a sequence waiting for seq's state shares no more of its prompt (a chunk's
        bytes do not depend on where chunks end, §1 of docs/DESIGN.md)."""
        p = seq.prefilled
        end = min(p + self.chunk, len(seq.prompt_ids))
        end = min([end] + [f.shared for f in self.sched.forks_of(seq) if p < f.shared < end])
        part = seq.prompt_ids[p:end]
        toks = np.zeros((self.chunk,), np.int32)
        toks[:len(part)] = part
        return p, part, toks

    def _prefill_chunk(self, seq: Sequence):
        p, part, toks = self._chunk_inputs(seq)
        logits, self.pool = self._prefill_step(self.r.params, self.pool, self.table(),
                                               *to_device(np.int32(seq.slot), toks, np.int32(p), np.int32(len(part))),
                                               self.r.rope,
                                               cfg=self.cfg, ops=self.ops, all_logits=seq.want_prompt_logprobs)
        self._chunk_done(seq, p, part, logits)

    def _mixed_step(self, seq: Sequence, decoding):
        """seq's next prefill chunk and one decode step of `decoding` in one device call (MIXED)."""
        p, part, toks = self._chunk_inputs(seq)
        P = self._rows(decoding)
        rtoks, running, pos, _, _ = self._inputs(decoding, P)
        logits, *outs, self.pool = self._mixed_pass(
            self.r.params, self.pool, self.table(),
            *to_device(np.int32(seq.slot), toks, np.int32(p), np.int32(len(part)), rtoks, running, pos), self.r.rope,
            cfg=self.cfg, ops=self.ops, all_logits=seq.want_prompt_logprobs, guard=self._guard(decoding),
            top_n=self.top_n)
        self.steps["mixed"] += 1
        self._chunk_done(seq, p, part, logits)
        self._step_done(decoding, P, *outs)

    def _chunk_done(self, seq: Sequence, p: int, part, logits):
        """After a prefill chunk: prompt logprobs, copies of the state for the sequences that share
        the prompt up to here, and the first token of each whose prompt is done."""
        all_logits = seq.want_prompt_logprobs
        self.steps["prefill"] += 1
        seq.prefilled += len(part)
        if all_logits:
            self._prompt_logprobs(seq, p, part, logits)
            last = logits[len(part) - 1]
        else:
            last = logits
        # the sequences waiting for seq's state up to here take a copy of it first (seq's own first
        # token may end it and free its pages), and those waiting for theirs in turn: row `last`
        # depends on the shared tokens only. One that waits for a copy's state at an earlier point
        # (its leader came past it by the copy) prefills its own.
        forks, todo, rows = [], [seq], None
        while todo:
            src = todo.pop(0)
            for f in self.sched.forks_of(src):
                if f.shared == src.prefilled:
                    rows = self._fork(src, f, last, rows)
                    forks.append(f)
                    todo.append(f)
                elif f.shared < src.prefilled:
                    f.fork_of = None
        for s in [seq] + forks:
            if s.prefilled < len(s.prompt_ids):  # its prompt goes on (a fork's, in its own chunks)
                continue
            if s.max_new_tokens == 0:
                self._finish(s, "length")
                continue
            t = choose(last, s)
            lp = top = None
            if self._need_lp():
                # the pick and the top on the device, as a decode step takes them (the row is a
                # vocabulary of floats: a host sort of it costs about 15 ms a prompt)
                rows = LOGPROBS(last[None], ops=self.ops) if rows is None else rows
                picked = PICK(rows, jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32))
                if self.top_n:
                    picked, (vals, best) = jax.device_get((picked, TOP(rows, self.top_n)))
                    top = (best[0].astype(np.int64).tolist(), vals[0].astype(np.float32))
                lp = np.asarray(picked)[0]
            self._record(s, t, lp, top)

    def _fork(self, src: Sequence, dst: Sequence, last, rows):
        """dst (its slot and pages admitted) takes a copy of src's state after the e tokens they share
        (src has prefilled exactly those) and their prompt logprobs; where dst's prompt goes on, its
        token e's logprob comes from the row that predicts it, src's last: the bytes dst's own
        prefill would have given. rows: log_softmax of that row, made here once. Returns rows."""
        e = src.prefilled
        table = self.blocks.table
        self.pool = FORK(self.pool, *to_device(np.int32(src.slot), np.int32(dst.slot), table[src.slot],
                                               table[dst.slot]))
        dst.prefilled = e
        if src.prompt_logprobs is not None:
            dst.prompt_logprobs = src.prompt_logprobs[:e]
            dst.prompt_top_logprobs = None if src.prompt_top_logprobs is None else src.prompt_top_logprobs[:e]
            if e < len(dst.prompt_ids):
                rows = LOGPROBS(last[None], ops=self.ops) if rows is None else rows
                self._add_prompt_logprobs(dst, rows, dst.prompt_ids[e:e + 1])
        dst.fork_of = None
        self.steps["forks"] += 1
        return rows

    def _decode_step(self, decoding):
        """One decode step: greedy ids from the device, sampled ones chosen here."""
        P = self._rows(decoding)
        toks, running, pos, _, _ = self._inputs(decoding, P)
        *outs, self.pool = self._decode_rows_step(
            self.r.params, self.pool, self.table(P), *to_device(toks, running, pos), self.r.rope,
            cfg=self.cfg, ops=self.ops, guard=self._guard(decoding), top_n=self.top_n)
        self._step_done(decoding, P, *outs)

    def _step_done(self, decoding, P: int, logits, lp_rows, ids, lp, top, vals):
        """After a decode step of P rows: each sequence's token (sampled ones drawn here), recorded."""
        self.steps["decode"] += 1
        self.steps["decode_rows"] += P
        self.steps["decode_calls"] += 1
        sampled = [s for s in decoding if not s.sampling.greedy]
        # the sampled rows drawn in one call over the step's rows (each row's bits are its own),
        # dispatched before one wait
        in_graph = None
        if sampled:
            samp, k_max = self._sampling_rows(decoding, P)
            in_graph = SAMPLE_ROWS(logits, *samp, k_max=k_max)
        ids, in_graph = jax.device_get((ids, in_graph))
        ids = np.array(ids)  # a copy: sampled rows' ids are written in
        if sampled:
            for s in sampled:
                ids[s.slot] = in_graph[s.slot]
            if lp is not None:  # every row's pick, so that one graph serves any number of sampled rows
                rows = np.array([s.slot for s in sampled], np.int32)
                picked = np.asarray(PICK(lp_rows, jnp.arange(P, dtype=jnp.int32), jnp.asarray(ids)))[rows]
        lp = None if lp is None else np.array(lp)
        if sampled and lp is not None:
            lp[rows] = picked
        top, vals = (None, None) if top is None else (np.asarray(top), np.asarray(vals))
        for seq in decoding:
            r = seq.slot
            self._record(seq, int(ids[r]), None if lp is None else lp[r],
                         None if top is None else (top[r].astype(np.int64).tolist(), vals[r]))

    def _decode_block(self, decoding, k: int):
        """k greedy decode steps in one device call; then each sequence's tokens in order, up to
        where it stopped (on the device, or here: a callback, a stop string). With chain, more
        blocks follow while the sequences have tokens left and nothing waits for a slot, each
        queued before the previous one's ids are read: a row the device stopped does not run in
        them, and a row stopped here (a callback, a stop string) costs at most one block."""
        P = self._rows(decoding)  # a chain's sequences only finish: its rows only shrink
        toks, running, pos, left, stops = self._inputs(decoding, P)
        toks, running, pos, left, stops = to_device(toks, running, pos, left, stops)
        carry = (toks, running, pos, left)
        samp, k_max = self._sampling_rows(decoding, P)
        kw = dict(cfg=self.cfg, ops=self.ops, guard=self._guard(decoding), top_n=self.top_n, block=self.block,
                  k_max=k_max)
        unqueued = {seq.slot: seq.max_new_tokens - len(seq.generated) for seq in decoding}
        table = self.table(P)
        pending = None
        while k > 0:
            # the table of the chain's start: a sequence finished during the chain gives its pages
            # back, but none is admitted (and no page zeroed) before the chain's blocks have run
            args = (self.r.params, self.pool, table) + carry + (stops, self.r.rope)
            n = None if k == self.block else jnp.int32(k)
            ids, lp, top, vals, self.pool, carry = DECODE_BLOCK(*args, n, samp, **kw)
            if samp is not None:  # the next block's first token is k further on
                samp = samp[:4] + (samp[4] + k,)
            self.steps["decode"] += k
            self.steps["decode_rows"] += k * P
            self.steps["decode_calls"] += 1
            self.steps["chained_calls"] += pending is not None
            for slot in unqueued:
                unqueued[slot] -= k
            if pending is not None:
                self._record_block(decoding, *pending)
            pending = (k, ids, lp, top, vals)
            k = self._chain_length(decoding, unqueued)
            fewer = self._chain_rows(decoding, unqueued, P) if k else P
            if fewer < P:  # the next blocks run the first `fewer` slots: their inputs' first rows
                P = fewer
                carry, stops, table = tuple(x[:P] for x in carry), stops[:P], table[:P]  # the start's table
                samp = None if samp is None else tuple(x[:P] for x in samp)
        self._record_block(decoding, *pending)

    def _sampling_rows(self, decoding, P: int):
        """sample_rows' inputs for a block of P rows, and its k_max: (None, None) where every
        sequence is greedy (the greedy graph)."""
        if all(s.sampling.greedy for s in decoding):
            return None, None
        return self._sampling_arrays(decoding, P), k_max_for([s.sampling for s in decoding], self.cfg.vocab_size)

    def _sampling_arrays(self, decoding, P: int):
        """(temperature, top_k, top_p, key data, index of the next token) of P rows, each sequence's
        at its slot, idle rows greedy."""
        t, k = np.zeros((P,), np.float32), np.zeros((P,), np.int32)
        p, keys, index = np.ones((P,), np.float32), np.zeros((P, 2), np.uint32), np.zeros((P,), np.int32)
        for seq in decoding:
            r = seq.slot
            t[r], k[r], p[r], keys[r] = row_params(seq.sampling, self.cfg.vocab_size)
            index[r] = len(seq.generated)
        return to_device(t, k, p, keys, index)

    def _chain_length(self, decoding, unqueued) -> int:
        """Steps of the next chained block: 0 (end the chain) unless chaining is on, nothing
        waits for a slot, and a sequence not yet seen to finish has tokens past those queued."""
        if not self.chain or self.sched.waiting:
            return 0
        left = [unqueued[s.slot] for s in decoding if s.finish_reason is None]
        return min(self.block, max(left)) if left and max(left) > 0 else 0

    def _record_block(self, decoding, k: int, ids, lp, top, vals):
        ids = np.asarray(ids)
        lp = None if lp is None else np.asarray(lp)
        top, vals = (None, None) if top is None else (np.asarray(top), np.asarray(vals))
        for seq in decoding:
            r = seq.slot
            if r >= ids.shape[1]:  # not among the block's rows: it had no token left to queue
                continue
            for i in range(k):
                if ids[i, r] < 0 or seq.finish_reason is not None:
                    break
                self._record(seq, int(ids[i, r]), None if lp is None else lp[i, r],
                             None if top is None else (top[i, r].astype(np.int64).tolist(), vals[i, r]))

    # --- per sequence ---------------------------------------------------------------------
    def _need_lp(self) -> bool:
        return self.top_n is not None  # None: no logprobs at all (a caller that wants speed alone)

    def _prompt_logprobs(self, seq, p, part, logits):
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
            seq.prompt_top_logprobs = [None] if seq.prompt_top_n else None
        self._add_prompt_logprobs(seq, LOGPROBS(logits, ops=self.ops), seq.prompt_ids[p + 1:p + len(part) + 1])

    def _add_prompt_logprobs(self, seq, rows, nxt):
        """seq's prompt logprobs (and tops) of the tokens nxt, nxt[i] predicted by log_softmax row i."""
        # each row's one value picked on the device: the rows themselves are chunk x vocabulary
        # floats (256 x 248k: 254 MB a chunk to bring over)
        want = np.zeros((rows.shape[0],), np.int32)
        want[:len(nxt)] = nxt
        lp = np.asarray(PICK(rows, jnp.arange(rows.shape[0], dtype=jnp.int32), jnp.asarray(want)))
        for i in range(len(nxt)):
            seq.prompt_logprobs.append(np.float32(lp[i]))
        if seq.prompt_top_n:
            # on the device: a host argsort of every prompt row over a large vocabulary is slow;
            # one k per pool (the widest asked) so that one graph serves every request
            k = max(self.top_n or 0, seq.prompt_top_n)
            vals, top = (np.asarray(x) for x in TOP(rows, k))
            for i in range(len(nxt)):
                seq.prompt_top_logprobs.append((top[i, :seq.prompt_top_n].astype(np.int64).tolist(),
                                                vals[i, :seq.prompt_top_n].astype(np.float32)))

    def _record(self, seq: Sequence, t: int, lp, top):
        """Token t is the sequence's next: its logprob and top (ids, values) when asked; then
        whether it ends the sequence."""
        now = time.perf_counter() - self.t0
        if seq.first_token_s is None:
            seq.first_token_s = now
        seq.token_times.append(now)
        seq.generated.append(t)
        if lp is not None:
            seq.logprobs.append(np.float32(lp))
            if top is not None:
                seq.top_logprobs.append((top[0], np.asarray(top[1], np.float32)))
        keep = self.on_token(seq.index, t) if self.on_token else None
        if t in seq.eos_ids:
            self._finish(seq, "eos")
        elif t in seq.stop_ids or keep is False or (seq.stop_strings and self._stopped_by_string(seq)):
            self._finish(seq, "stop")
        elif len(seq.generated) >= seq.max_new_tokens:
            self._finish(seq, "length")

    def _stopped_by_string(self, seq) -> bool:
        """Whether a stop string is in the text now. It was not before this token, so a new one
        ends in this token's bytes and starts at most its length in bytes back: a window of
        recent tokens whose text holds that many bytes, plus 4 spare tokens before it that absorb
        what a decode starting mid-character or after a dropped leading space changes at the
        window's start, holds it. A token is a byte or more of text, except special tokens a
        decode may drop: the window doubles while its text is short. Decoding the whole text
        at every token instead costs the square of the length (2,000 tokens: about 2 million
        token decodes a sequence)."""
        gen = seq.generated
        need = max(len(s.encode("utf-8")) for s in seq.stop_strings)
        w = need
        while w < len(gen) and len(self.tok.decode(gen[-w:]).encode("utf-8")) < need:
            w *= 2
        text = self.tok.decode(gen[-(w + 4):])
        return any(s in text for s in seq.stop_strings)

    def _finish(self, seq: Sequence, reason: str):
        self._drop_head(seq)
        if self.keep_states:
            seq.state = jax.tree_util.tree_map(np.asarray, TAKE(self.pool, self.table(), jnp.int32(seq.slot)))
        self.sched.finish(seq, reason)



def _device_stops(seq: Sequence) -> list:
    return sorted(seq.eos_ids | seq.stop_ids)


DEFAULT_BATCH_CHUNK = 256  # prefill rows per step of a batch (the step's token budget for a prompt)
TIER_MAX_BATCH_CHUNK = 1024


def default_chunk(eng, ids, news, length: int) -> int:
    """The prefill chunk of a batch when none is given. Resident: DEFAULT_BATCH_CHUNK, short enough
    that a round's prefill does not hold the decoding sequences long. Tier: every prefill pass moves
    all of a layer's routed experts over the host link whatever its rows, so a chunk of 256 would
    pay that once per 256 tokens; the runner's own pick for the longest prompt instead, up to
    TIER_MAX_BATCH_CHUNK rows so that the chunk's activations leave the pool its slots."""
    if eng.runner.placement != "tier":
        return min(DEFAULT_BATCH_CHUNK, length)
    i = max(range(len(ids)), key=lambda j: len(ids[j]))
    return max(1, min(TIER_MAX_BATCH_CHUNK, length, eng.pick_chunk(len(ids[i]), news[i])))
MAX_DEFAULT_SLOTS = 64


def _per_prompt(name, value, n, check):
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"generate_batch: {name} has {len(value)} entries for {n} prompts (give one, or one each)")
        return [check(v) for v in value]
    v = check(value)
    return [v] * n


def check_batchable(eng, what: str = "generate_batch"):
    """Refuse what the pool cannot run: every placement can (resident, tier, expert parallel), but
    the pool holds no pending delta block, which delta_rule 'blocked' keeps per sequence."""
    if eng.cfg.delta_rule != "token":
        raise ValueError(f"{what} runs the per-token delta rule (delta_rule 'token', BARO_DELTA=token), not "
                         f"{eng.cfg.delta_rule!r}: the sequence pool holds no pending delta block; run the prompts "
                         "one at a time with generate()")


def open_run(eng, *, max_batch: int, length: int, chunk: int, logprobs: int | None, stop_width: int,
             prefill_budget: int | None = None, what: str = "the pool") -> BatchRun:
    """An empty BatchRun of max_batch slots of `length` positions that sequences join with add()
    and leave with cancel(), stepped by its owner (a server's engine loop). Its graphs are fixed
    here, so nothing compiles per request. A pool the device budget cannot hold is refused now."""
    check_batchable(eng, what)
    slots, pages = _slots(eng, max_batch, max_batch, length, chunk)
    return BatchRun(eng.runner, eng.tokenizer, [], slots=slots, length=length, chunk=chunk, logprobs=logprobs,
                    keep_states=False, block=eng.runner.decode_block, stop_width=stop_width, chain=False,
                    prefill_budget=prefill_budget, pages=pages)


def pool_for(eng, ids, news, max_batch, chunk) -> tuple[int, int, int, int]:
    """(slots, KV pages, positions per slot, prefill chunk) of the pool generate_batch opens for
    these prompts (token-id lists) and max_new_tokens at max_batch / chunk (None: its own choice).
    Refuses, naming what does not fit, a sequence past max_context or a pool the device budget
    cannot hold: a caller that plans several batches checks them all before any work."""
    for x, m in zip(ids, news):
        eng.check_fits(len(x), m)
    length = state_length(max(len(x) + m for x, m in zip(ids, news)), eng.cfg.max_context)
    chunk = checks.as_int("chunk", chunk, lo=1) if chunk is not None else default_chunk(eng, ids, news, length)
    slots, pages = _slots(eng, len(ids), max_batch, length, chunk, [positions_of(len(x), m) for x, m in zip(ids, news)])
    return slots, pages, length, chunk


def sample_seeds(sampling: Sampling, n: int, what: str = "generate_batch") -> list[Sampling]:
    """The samplings of a prompt's n samples: sample j draws with seed + j (so it is the run
    alone with that seed); a ValueError naming n where seed + n - 1 is past the seed range."""
    if n > 1 and sampling.seed + n - 1 > SEED_RANGE[1]:
        raise ValueError(f"{what}: sample j of a prompt draws with seed + j, and seed {sampling.seed} + {n - 1} "
                         f"is past the largest seed {SEED_RANGE[1]}: give a smaller seed or n")
    return [dataclasses.replace(sampling, seed=sampling.seed + j) for j in range(n)]


def generate_batch(eng, prompts, max_new_tokens, *, sampling, logprobs, prompt_logprobs, max_batch, chunk, stop,
                   stop_token_ids, stop_at_eos, keep_states, on_token, sequence_type, prefill_budget=None,
                   n_samples=1, shares=None, share_prefixes=True):
    """Engine.generate_batch's body (see there; n_samples is its n). shares: per prompt, None or
    (j, f): prompt j < i starts with prompt i's first f tokens, whose state prompt i copies from it
    (score_batch's pairs of one prompt); share_prefixes: BatchRun's."""
    check_batchable(eng)
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError(f"generate_batch: prompts must be a list of prompts (texts or token-id lists), "
                        f"got {type(prompts).__name__}")
    if len(prompts) == 0:
        return []
    ks = _per_prompt("n", n_samples, len(prompts), lambda v: checks.as_int("n", v, lo=1))
    n = sum(ks)
    ids = [eng.check_ids(eng.encode(p)) for p in prompts]
    for i, x in enumerate(ids):
        if not x:
            raise ValueError(f"generate_batch: prompt {i} is empty")
    news = _per_prompt("max_new_tokens", max_new_tokens, len(prompts),
                       lambda v: checks.as_int("max_new_tokens", v, lo=0))
    samplings = _per_prompt("sampling", sampling if sampling is not None else Sampling(), len(prompts),
                            eng.sampling_for)
    # each prompt's samples side by side (n = 2: result 2 i + j is prompt i's sample j)
    ids = [x for x, k in zip(ids, ks) for _ in range(k)]
    news = [m for m, k in zip(news, ks) for _ in range(k)]
    samplings = [s for sp, k in zip(samplings, ks) for s in sample_seeds(sp, k)]
    firsts = [i for i, k in enumerate(ks) for _ in range(k)]  # each sample's prompt
    top_n = check_logprobs(logprobs, eng.cfg.vocab_size)
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token must be a callable (or None), got {type(on_token).__name__}")
    stops = tuple(_stop_strings(stop))
    stop_ids = frozenset(eng.check_ids(list(stop_token_ids or [])))
    eos = eng.eos_ids if stop_at_eos else frozenset()
    slots, pages, length, chunk = pool_for(eng, ids, news, max_batch, chunk)
    seqs = [sequence_type(index=i, prompt_ids=x, max_new_tokens=m, sampling=s, stop_ids=stop_ids,
                          stop_strings=stops, eos_ids=eos, want_prompt_logprobs=bool(prompt_logprobs))
            for i, (x, m, s) in enumerate(zip(ids, news, samplings))]
    first = {}
    for seq, i in zip(seqs, firsts):  # a prompt's later samples copy its first one's prompt state
        if i in first:
            seq.fork_of = first[i]
        else:
            first[i] = seq
            if shares is not None and shares[i] is not None:
                seq.fork_of, seq.fork_at = first[shares[i][0]], shares[i][1]
    run = BatchRun(eng.runner, eng.tokenizer, seqs, slots=slots, length=length, chunk=chunk, logprobs=top_n,
                   keep_states=keep_states, on_token=on_token, block=eng.runner.decode_block,
                   prefill_budget=prefill_budget, pages=pages, share_prefixes=share_prefixes)
    t0 = time.perf_counter()
    done = run.run()
    dt = time.perf_counter() - t0
    out = []
    for seq in done:
        text = eng.tokenizer.decode(seq.generated)
        if seq.finish_reason == "stop":
            text = cut_at_stop(text, stops)
        gaps = np.diff(seq.token_times) if len(seq.token_times) > 1 else np.zeros(0)
        out.append(GenerateResult(
            prompt_ids=seq.prompt_ids, generated_ids=seq.generated, text=text,
            prefill_seconds=seq.first_token_s or 0.0,
            prefill_tokens_per_s=len(seq.prompt_ids) / seq.first_token_s if seq.first_token_s else 0.0,
            decode_tokens_per_s=float(len(gaps) / gaps.sum()) if gaps.size and gaps.sum() > 0 else 0.0,
            model=eng.name, backend=eng.backend, prefill_mode="batch", chunk=chunk, mode=eng.mode,
            variant=eng.variant, state=seq.state, logprobs=seq.logprobs,
            top_logprobs=seq.top_logprobs if top_n else None,
            prompt_logprobs=seq.prompt_logprobs if prompt_logprobs else None, finish_reason=seq.finish_reason))
    tier_cache = eng.runner.cache_slots if eng.runner.placement == "tier" else None
    eng.last_batch_stats = {"sequences": n, "slots": slots, "pool_length": length, "kv_pages": pages,
                            "kv_page": run.blocks.page, "chunk": chunk,
                            "budget_counted_bytes": budget.batch_counted_bytes(
                                eng.cfg, eng.dtype, length, chunk, slots, pages, eng.devices or 1, tier_cache,
                                page=run.blocks.page),
                            "prefill_budget": run.prefill_budget,
                            "steps": dict(run.steps), "seconds": dt,
                            "generated_tokens": sum(len(s.generated) for s in done)}
    return out


def score_batch(eng, prompts, continuations, *, chunk, max_batch, share_prefixes=True) -> list:
    """Engine.score_batch's body (see there)."""
    for name, v in (("prompts", prompts), ("continuations", continuations)):
        if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
            raise TypeError(f"score_batch: {name} must be a list (of texts or token-id lists), got {type(v).__name__}")
    if len(prompts) != len(continuations):
        raise ValueError(f"score_batch: {len(prompts)} prompts and {len(continuations)} continuations (one each)")
    ps = [eng.check_ids(eng.encode(p)) for p in prompts]
    cs = [eng.check_ids(eng.encode(c)) for c in continuations]
    for i, (p, c) in enumerate(zip(ps, cs)):
        if not p:
            raise ValueError(f"score_batch: prompt {i} is empty (the first token has no log-probability)")
        if not c:
            raise ValueError(f"score_batch: continuation {i} is empty")
    if not ps:
        return []
    # the pairs of one prompt (an RL batch: many rollouts of each prompt) prefill it once: each later
    # pair copies the first one's state after the prompt, and prefills its own continuation
    first, shares = {}, []
    for i, p in enumerate(ps):
        j = first.setdefault(tuple(p), i) if share_prefixes else i
        shares.append(None if j == i else (j, len(p)))
    with eng.exclusive():
        res = generate_batch(eng, [p + c for p, c in zip(ps, cs)], 0, sampling=None, logprobs=0,
                             prompt_logprobs=True, max_batch=max_batch, chunk=chunk, stop=None, stop_token_ids=None,
                             stop_at_eos=False, keep_states=False, on_token=None, sequence_type=Sequence,
                             shares=shares, share_prefixes=share_prefixes)
    return [np.asarray(r.prompt_logprobs[len(p):], np.float32) for p, r in zip(ps, res)]


def cut_at_stop(text: str, stops) -> str:
    """The text up to the first stop string in it (what a stopped sequence returns, as the peers
    do); the whole text when none is in it."""
    cut = [text.find(s) for s in stops if s in text]
    return text[:min(cut)] if cut else text


def _stop_strings(stop):
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    out = []
    for s in stop:
        if not isinstance(s, str) or not s:
            raise TypeError(f"stop must be a string or a list of non-empty strings, got {s!r:.60}")
        out.append(s)
    return out


def _slots(eng, n: int, max_batch, length: int, chunk: int, positions: list | None = None) -> tuple[int, int]:
    """(slots, KV pages) of the pool: max_batch slots, or as many as the prompts (at most
    MAX_DEFAULT_SLOTS) and what the device budget holds beside the weights and a prefill chunk;
    pages: what the budget holds beside them, no more than every slot at `length` needs (a count
    that depends on the slots and the length alone, never on the prompts: the pool's shapes key
    the graphs). positions (each sequence's KV positions): the longest must fit the pages."""
    if max_batch is not None:
        slots = min(checks.as_int("max_batch", max_batch, lo=1), n)  # more slots than prompts would idle
    else:
        slots = min(n, MAX_DEFAULT_SLOTS)
    page = DEFAULT_KV_PAGE
    need = None if positions is None else [pages_for(p, page) for p in positions]
    longest = max(need) if need else pages_for(length, page)
    tier = eng.runner.placement == "tier"
    fit, pages = budget.batch_slots(eng.cfg, eng.dtype, eng.device_budget_gb, length, chunk, slots, eng.devices or 1,
                                    eng.runner.cache_slots if tier else None, page=page, longest=longest)
    if fit < 1 and tier:
        budget.check_tier(eng.cfg, eng.dtype, eng.device_budget_gb, length, chunk, eng.runner.cache_slots)
    elif fit < 1:
        budget.check_resident(eng.cfg, eng.dtype, eng.device_budget_gb, length, chunk, eng.devices or 1)
    if max_batch is not None and fit < slots:
        raise MemoryError(f"max_batch {slots} slots (each with at least one KV page of {page} positions, and the "
                          f"{longest} pages of the longest sequence) do not fit the device budget beside the weights "
                          f"and a prefill chunk of {chunk} rows; at most {fit} do")
    if pages < longest:
        what = "the longest sequence" if need else f"a sequence of {length} positions"
        size = budget.gib(longest * Pool.page_bytes(eng.cfg, eng.dtype, page))
        # fit is 0 here unless batch_slots is not the budget's own: say what one slot would have
        one = pages if fit else budget.batch_slots(eng.cfg, eng.dtype, eng.device_budget_gb, length, chunk, 1,
                                                   eng.devices or 1, eng.runner.cache_slots if tier else None,
                                                   page=page)[1]
        raise MemoryError(f"the KV pages of {what} ({longest} pages of {page} positions, {size}) do not fit the "
                          f"device budget beside the weights, a slot and a prefill chunk of {chunk} rows; {one} do")
    return max(1, min(slots, fit)), pages
