"""The identity gate's many-sequence axis: each sequence of Engine.generate_batch must get the
bytes it gets alone, whatever the slot count, the prefill chunk and the other sequences.

For every (prompt, max_new_tokens, sampling) the run alone (`generate()`, batched prefill) runs
once, and, for the sequences named in `replay`, the replay path alone (`generate(prefill=
"replay")`); then every batch configuration (max_batch, chunk) runs generate_batch over all the
prompts, and each of its sequences is compared with the runs alone: generated ids, logprob bytes
and final-state bytes. The batch's KV cache has the pool's length and the one alone its own, so
KV leaves are compared over the positions both hold; every other leaf whole.

Host memory, not device memory, holds the states: generate_batch(keep_states=True) returns host
arrays, and each run alone's state is copied to the host and its device buffers dropped before
the next run. The runs alone are kept for the whole gate (one state each, at its own length); a
configuration's batch states are dropped row by row as they are compared. Every comparison is
linear in the state's size, and the runs alone are computed once, not once per configuration.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from .digests import arm_digest, host_leaves, same_bytes, state_names
from .records import echo

FULL = "full_attention"


# --- what is compared ------------------------------------------------------------------------

def kv_flags(cfg) -> list[bool]:
    """Per state leaf, in host_leaves order (digests.state_names'): whether it is an attention KV
    cache, whose first axis is the position (and whose length is the state's, not the sequence's)."""
    flags = []
    for t in cfg.layer_types:
        if t == FULL:
            flags += [True, True]  # k, v
        else:
            flags += [False] * (5 if getattr(cfg, "delta_rule", "token") == "blocked" else 2)
    return flags


@dataclasses.dataclass
class Outcome:
    """One sequence's result as host arrays: ids, logprobs (float32), state leaves, finish reason."""
    ids: list
    logprobs: np.ndarray
    state: list
    finish: str | None

    @classmethod
    def of(cls, res, what: str) -> "Outcome":
        """From a GenerateResult that kept its state and its logprobs."""
        if res.state is None:
            raise ValueError(f"{what}: the result has no state (keep_state / keep_states was not honoured)")
        if res.logprobs is None:
            raise ValueError(f"{what}: the result has no logprobs (logprobs=0 was not honoured)")
        lp = np.asarray(res.logprobs, np.float32).reshape(-1)
        return cls(list(res.generated_ids), lp, host_leaves(res.state), res.finish_reason)


def common_leaves(a: list, b: list, kv: list[bool]) -> tuple[list, list]:
    """a's and b's leaves with each KV cache cut to the positions both hold (the shorter's
    length); other leaves as they are. Views, not copies."""
    out_a, out_b = [], []
    for i, (x, y) in enumerate(zip(a, b)):
        if i < len(kv) and kv[i] and x.ndim >= 1 and y.ndim >= 1:
            n = min(x.shape[0], y.shape[0])
            x, y = x[:n], y[:n]
        out_a.append(x)
        out_b.append(y)
    return out_a, out_b


def cut_to(state: list, length: int, kv: list[bool]) -> list:
    """The state with every KV cache cut to its first `length` positions (the digest's view)."""
    return [x[:length] if i < len(kv) and kv[i] else x for i, x in enumerate(state)]


def kv_length(state: list, kv: list[bool]) -> int | None:
    """The state's KV length (None: no attention layer)."""
    for x, f in zip(state, kv):
        if f:
            return int(x.shape[0])
    return None


def first_position(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first index along axis 0 whose bytes differ (same dtype and shape assumed)."""
    n = a.shape[0] if a.ndim else 1
    ra = np.ascontiguousarray(a).view(np.uint8).reshape(n, -1)
    rb = np.ascontiguousarray(b).view(np.uint8).reshape(n, -1)
    hit = np.flatnonzero((ra != rb).any(axis=1))
    return int(hit[0]) if hit.size else None


def outcome_digest(o: Outcome, length: int | None, kv: list[bool]) -> str:
    """sha256 (digests.arm_digest) over the state (KV cut to `length` positions), the logprobs'
    bytes and the ids: equal for two runs exactly when they agree over those positions."""
    st = o.state if length is None else cut_to(o.state, length, kv)
    return arm_digest([np.ascontiguousarray(x) for x in st], o.logprobs, o.ids)


def compare(ref: Outcome, got: Outcome, names: list[str], kv: list[bool]) -> dict:
    """How `got` (a sequence of a batch) compares with `ref` (the same sequence alone), in bytes:
    equal_ids, equal_logprobs, equal_state, equal_finish, and where they first differ:
    first_token_diff (the first generated position whose id or logprob differs),
    first_state_diff (a leaf name), first_state_diff_pos (its first differing position, for a KV
    leaf)."""
    equal_ids = ref.ids == got.ids
    equal_lp = same_bytes(ref.logprobs, got.logprobs)
    first_tok = None
    if not (equal_ids and equal_lp):
        n = min(len(ref.ids), len(got.ids), ref.logprobs.size, got.logprobs.size)
        for i in range(n):
            if ref.ids[i] != got.ids[i] or ref.logprobs[i:i + 1].tobytes() != got.logprobs[i:i + 1].tobytes():
                first_tok = i
                break
        else:
            first_tok = n  # one is a prefix of the other
    a, b = common_leaves(ref.state, got.state, kv)
    leaf, pos = None, None
    for i, (x, y) in enumerate(zip(a, b)):
        if not same_bytes(x, y):
            leaf = names[i] if i < len(names) else f"leaf {i}"
            if x.dtype == y.dtype and x.shape == y.shape and x.ndim >= 1 and i < len(kv) and kv[i]:
                pos = first_position(x, y)
            break
    if leaf is None and len(ref.state) != len(got.state):
        i = min(len(ref.state), len(got.state))
        leaf = names[i] if i < len(names) else f"leaf {i}"
    return {"equal_ids": equal_ids, "equal_logprobs": equal_lp, "equal_state": leaf is None,
            "equal_finish": ref.finish == got.finish, "first_token_diff": first_tok,
            "first_state_diff": leaf, "first_state_diff_pos": pos}


def equal(c: dict) -> bool:
    return bool(c["equal_ids"] and c["equal_logprobs"] and c["equal_state"] and c["equal_finish"])


def row_ok(row: dict) -> bool:
    """A batch row equals its run alone, and its replay alone where it has one."""
    return equal(row) and (row["replay"] is None or equal(row["replay"]))


# --- the inputs the command line and the tests draw ---------------------------------------------

def length_mix(n: int, max_len: int, chunks: Sequence[int], seed: int = 0) -> list[int]:
    """n prompt lengths in [1, max_len]: exactly 1, max_len, and for each chunk c a chunk boundary
    (c), one past it (c + 1) and several chunks (3c + 1) where they fit; the rest spread
    log-uniformly over [1, max_len]; in an order drawn from `seed`, so long and short prompts
    arrive mixed. Distinct where n <= max_len allows."""
    if n < 1:
        raise ValueError(f"length_mix: n must be >= 1, got {n}")
    if max_len < 1:
        raise ValueError(f"length_mix: max_len must be >= 1, got {max_len}")
    want = [1, max_len]
    for c in sorted({int(c) for c in chunks if c}):
        want += [c, c + 1, 3 * c + 1]
    picked: list[int] = []
    for x in want:
        if 1 <= x <= max_len and x not in picked and len(picked) < n:
            picked.append(x)
    rng = np.random.default_rng(seed)
    tries = 0
    while len(picked) < n:
        x = int(round(float(np.exp(rng.uniform(0.0, np.log(max_len))))))
        x = min(max(x, 1), max_len)
        tries += 1
        # repeats only once every length is taken (n > max_len)
        if x not in picked or len(picked) >= max_len or tries > 100 * n:
            picked.append(x)
    order = rng.permutation(len(picked))
    return [picked[i] for i in order]


def random_prompts(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, ids uniform in [0, vocab) from `seed`."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, int(n))] for n in lengths]


def share_prefixes(prompts: Sequence[Sequence[int]], k: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The prompts with the last k rewritten to start as an earlier one does (the pool copies the
    earlier one's state there instead of prefilling the common tokens, batch.prefix_shares): prompt
    i takes the first f tokens of the longest of the four prompts before it (near it in the queue,
    so it may get a slot while that one still prefills; f from half of it to all of it),
    then up to 64 tokens of its own, or none (a prompt that is another's prefix, or its copy). The
    runs alone are unchanged in kind: each prompt alone, the same bytes expected."""
    rng = np.random.default_rng(seed + 2)
    out = [list(p) for p in prompts]
    n, longest = len(out), max(len(p) for p in prompts)  # no longer than the longest given
    for i in range(max(1, n - k), n):
        j = max(range(max(0, i - 4), i), key=lambda t: len(out[t]))
        src = out[j]
        f = int(rng.integers(max(1, len(src) // 2), len(src) + 1))
        tail = min(int(rng.integers(0, 65)) if rng.random() < 0.75 else 0, longest - f)
        out[i] = src[:f] + [int(t) for t in rng.integers(0, vocab, tail)]
    return out


def new_token_mix(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """n max_new_tokens in [lo, hi], uniform from `seed`, with hi and lo both present when n >= 2
    (sequences that finish at different steps, so that freed slots take new arrivals mid-decode)."""
    if not 0 <= lo <= hi:
        raise ValueError(f"new_token_mix: need 0 <= lo <= hi, got lo={lo}, hi={hi}")
    rng = np.random.default_rng(seed + 1)
    out = [int(x) for x in rng.integers(lo, hi + 1, n)]
    if n >= 1:
        out[0] = hi
    if n >= 2:
        out[1] = lo
    return out


def spread(indices: Sequence[int], lengths: Sequence[int], k: int, max_len: int | None = None) -> list[int]:
    """k of `indices` whose lengths spread from the shortest to the longest (at most max_len
    tokens, when given): the replay subset, whose cost grows with the prompt's length."""
    pool = sorted((i for i in indices if max_len is None or lengths[i] <= max_len), key=lambda i: (lengths[i], i))
    if k <= 0 or not pool:
        return []
    if k >= len(pool):
        return sorted(pool)
    picks = np.linspace(0, len(pool) - 1, k).round().astype(int)
    return sorted({pool[j] for j in picks})


# --- the gate ----------------------------------------------------------------------------------

def sampling_dict(s) -> dict:
    return {"temperature": float(s.temperature), "top_k": int(s.top_k), "top_p": float(s.top_p),
            "seed": int(s.seed)}


def per_prompt(name: str, value, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"batch identity: {name} has {len(value)} entries for {n} prompts (give one, or one each)")
        return list(value)
    return [value] * n


def parse_configs(spec: str, n: int) -> list[tuple[int | None, int | None]]:
    """"B:C,B:C,..." -> [(max_batch, chunk)]; B and C are integers or "auto" (generate_batch's
    own choice); B may also be "n" (the prompt count) or "n/K" (the prompt count over K, at
    least 1)."""
    out = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part.count(":") != 1:
            raise ValueError(f"batch configuration {part!r}: expected MAX_BATCH:CHUNK, e.g. 16:32")
        b, c = (x.strip().lower() for x in part.split(":"))
        try:
            if b == "auto":
                mb = None
            elif b == "n":
                mb = n
            elif b.startswith("n/"):
                mb = max(1, n // int(b[2:]))
            else:
                mb = int(b)
            ch = None if c == "auto" else int(c)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"batch configuration {part!r}: MAX_BATCH is an integer, n, n/K or auto; CHUNK an "
                             "integer or auto") from None
        if (mb is not None and mb < 1) or (ch is not None and ch < 1):
            raise ValueError(f"batch configuration {part!r}: max_batch and chunk must be >= 1")
        out.append((mb, ch))
    if not out:
        raise ValueError(f"no batch configuration in {spec!r}")
    return out


@dataclasses.dataclass
class BatchIdentityReport:
    """What a run found. sequences: one dict per prompt (its run alone: digests, seconds; its
    replay alone, compared with the run alone, where it has one). configs: one dict per batch
    configuration (slots, pool length, steps, seconds, failures). rows: one dict per configuration
    x sequence."""
    sequences: list = dataclasses.field(default_factory=list)
    configs: list = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)
    alone_seconds: float = 0.0
    replay_seconds: float = 0.0
    wall_seconds: float = 0.0
    reference: dict | None = None  # compare_reference's account, when a reference run was given

    @property
    def row_failures(self) -> int:
        return sum(not row_ok(r) for r in self.rows)

    @property
    def reference_failures(self) -> int:
        """Sequences whose run alone differs from the reference run's (another mode's)."""
        return len(self.reference["differing"]) if self.reference else 0

    @property
    def replay_failures(self) -> int:
        """Sequences whose replay alone differs from their run alone."""
        return sum(s["replay"] is not None and not equal(s["replay"]) for s in self.sequences)

    @property
    def failures(self) -> int:
        return self.row_failures + self.replay_failures + self.reference_failures

    @property
    def ok(self) -> bool:
        """Every row equal, and at least one row (a gate that compared nothing proves nothing)."""
        return bool(self.rows) and self.failures == 0

    def summary(self) -> dict:
        rows = self.rows
        return {"pass": self.ok, "failures": self.failures, "rows": len(rows),
                "sequences": len(self.sequences), "configs": len(self.configs),
                "rows_equal": sum(row_ok(r) for r in rows),
                "equal_ids": sum(bool(r["equal_ids"]) for r in rows),
                "equal_logprobs": sum(bool(r["equal_logprobs"]) for r in rows),
                "equal_state": sum(bool(r["equal_state"]) for r in rows),
                "replay_rows": sum(r["replay"] is not None for r in rows),
                "replay_rows_equal": sum(r["replay"] is not None and equal(r["replay"]) for r in rows),
                "replay_sequences": sum(s["replay"] is not None for s in self.sequences),
                "replay_equal_alone": sum(s["replay"] is not None and equal(s["replay"]) for s in self.sequences),
                "alone_seconds": self.alone_seconds, "replay_seconds": self.replay_seconds,
                "wall_seconds": self.wall_seconds, **({"reference": self.reference} if self.reference else {})}

    def to_json(self, **extra) -> dict:
        """{"summary": summary() with `extra` merged in (model, provenance, ...), "sequences",
        "configs", "rows"}."""
        return {"summary": {**self.summary(), **extra}, "sequences": self.sequences, "configs": self.configs,
                "rows": self.rows}

    def partial_json(self, **extra) -> dict:
        """What a run cut short leaves: everything so far, no verdict."""
        return {"summary": {"pass": None, "partial": True, "rows": len(self.rows), **extra},
                "sequences": self.sequences, "configs": self.configs, "rows": self.rows}


def compare_reference(sequences: list, path: str) -> dict:
    """How each sequence's run alone (its digest: ids, logprob bytes, state over its own KV length)
    compares with the same sequence in another gate run's JSON (`path`: the same prompts in another
    mode, e.g. resident for a tier run). {"file", "compared", "differing": [indices]}. A reference
    of other sequences (a prompt length, new-token count or sampling that differs) is an error,
    not a pass."""
    import json

    with open(path) as f:
        ref = json.load(f)["sequences"]
    if len(ref) != len(sequences):
        raise ValueError(f"reference {path}: {len(ref)} sequences, this run has {len(sequences)} (run it with the "
                         "same --n, --max-len, --new-tokens and --prompt-seed)")
    differing = []
    for s, r in zip(sequences, ref):
        for key in ("prompt_len", "new_tokens", "sampling", "kv_length"):
            if s[key] != r[key]:
                raise ValueError(f"reference {path}: sequence {s['index']} has {key} {r[key]!r} there, {s[key]!r} "
                                 "here: not the same sequences")
        if s["digest"] != r["digest"]:
            differing.append(s["index"])
    return {"file": path, "compared": len(sequences), "differing": differing}


def format_config(c: dict) -> str:
    """The one line a configuration prints."""
    rep = f", replay {c['replay_equal']}/{c['replay_rows']}" if c["replay_rows"] else ""
    return (f"max_batch={c['max_batch']} chunk={c['chunk']}: {'PASS' if c['failures'] == 0 else 'FAIL'} "
            f"{c['rows_equal']}/{c['rows']} sequences equal alone (ids {c['equal_ids']}, logprobs "
            f"{c['equal_logprobs']}, state {c['equal_state']}){rep} | {c['slots']} slots x {c['pool_length']} "
            f"positions, chunk {c['chunk_used']}, steps prefill {c['steps'].get('prefill')} (state copies "
            f"{c['steps'].get('forks', 0)}) decode "
            f"{c['steps'].get('decode')}, {c['seconds']:.2f}s")


def run_batch_identity(eng, prompts: Sequence[Sequence[int]], new_tokens, samplings, configs, *,
                       replay: Sequence[int] = (), alone_chunk: int | None = None,
                       on_progress: Callable[[BatchIdentityReport], None] | None = None,
                       log: Callable[[str], None] | None = echo) -> BatchIdentityReport:
    """The gate on an Engine over `prompts` (token-id lists).

    new_tokens: one max_new_tokens for all, or one per prompt; samplings: one baro_jax.Sampling
    (None: greedy) for all, or one per prompt. configs: [(max_batch, chunk)] for generate_batch
    (None: its own choice). replay: indices of the prompts also run through the replay path
    alone. alone_chunk: the prefill chunk of the runs alone (None: generate()'s own pick).
    on_progress(report) runs after the runs alone and after each configuration (to write partial
    results); log gets one line per configuration (None: quiet)."""
    from baro_jax.sampling import Sampling

    say = log or (lambda _msg: None)
    prompts = [list(p) for p in prompts]
    n = len(prompts)
    if n == 0:
        raise ValueError("batch identity: no prompts")
    news = [int(x) for x in per_prompt("new_tokens", new_tokens, n)]
    sps = [s if s is not None else Sampling() for s in per_prompt("samplings", samplings, n)]
    configs = [(None if b is None else int(b), None if c is None else int(c)) for b, c in configs]
    if not configs:
        raise ValueError("batch identity: no batch configuration")
    replay = sorted({int(i) for i in replay})
    bad = [i for i in replay if not 0 <= i < n]
    if bad:
        raise ValueError(f"batch identity: replay indices {bad} are outside the {n} prompts")
    # every configuration's pool against the device budget before any work: one that cannot be
    # held is refused now, named, not after the runs alone and the configurations before it
    from baro_jax.batch import pool_for
    for b, c in configs:
        try:
            pool_for(eng, prompts, news, b, c)
        except MemoryError as e:
            raise MemoryError(f"batch identity: configuration max_batch={'auto' if b is None else b} "
                              f"chunk={'auto' if c is None else c} does not fit: {e}") from None
    names, kv = state_names(eng.cfg), kv_flags(eng.cfg)
    rep = BatchIdentityReport()
    t_start = time.time()

    def checked(o: Outcome, what: str) -> Outcome:
        if len(o.state) != len(names):
            raise ValueError(f"{what}: the state has {len(o.state)} leaves, the model's state has {len(names)} "
                             f"({', '.join(names[:4])}, ...)")
        return o

    # Runs alone, once per distinct (prompt, max_new_tokens, sampling): repeats share them.
    alone: dict = {}
    replayed: dict = {}
    key_of = [(tuple(p), m, s) for p, m, s in zip(prompts, news, sps)]
    t0 = time.perf_counter()
    for i, key in enumerate(key_of):
        if key not in alone:
            r = eng.generate(prompts[i], news[i], sampling=sps[i], logprobs=0, keep_state=True, stop_at_eos=False,
                             chunk=alone_chunk)
            alone[key] = checked(Outcome.of(r, f"prompt {i} alone"), f"prompt {i} alone")
            del r  # the device state goes now; its host copy stays
    rep.alone_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in replay:
        if key_of[i] not in replayed:
            r = eng.generate(prompts[i], news[i], sampling=sps[i], logprobs=0, keep_state=True, stop_at_eos=False,
                             prefill="replay")
            replayed[key_of[i]] = checked(Outcome.of(r, f"prompt {i} replay"), f"prompt {i} replay")
            del r
    rep.replay_seconds = time.perf_counter() - t0
    for i, key in enumerate(key_of):
        a = alone[key]
        L = kv_length(a.state, kv)
        seq = {"index": i, "prompt_len": len(prompts[i]), "new_tokens": news[i], "sampling": sampling_dict(sps[i]),
               "generated": len(a.ids), "kv_length": L, "digest": outcome_digest(a, L, kv), "replay": None}
        if key in replayed:
            r = replayed[key]
            seq["replay"] = {**compare(a, r, names, kv), "digest": outcome_digest(r, L, kv)}
            if not equal(seq["replay"]):
                say(f"prompt {i} ({len(prompts[i])} tokens): replay alone differs from batched prefill alone "
                    f"({_what_differs(seq['replay'])})")
        rep.sequences.append(seq)
    if on_progress is not None:
        on_progress(rep)

    for ci, (mb, ch) in enumerate(configs):
        t0 = time.perf_counter()
        got = eng.generate_batch(prompts, news, sampling=sps, logprobs=0, max_batch=mb, chunk=ch,
                                 stop_at_eos=False, keep_states=True)
        secs = time.perf_counter() - t0
        stats = dict(getattr(eng, "last_batch_stats", None) or {})
        if len(got) != n:
            raise ValueError(f"generate_batch returned {len(got)} results for {n} prompts (max_batch={mb}, "
                             f"chunk={ch})")
        rows = []
        for i in range(n):
            res, got[i] = got[i], None  # each batch state is let go once compared
            if list(res.prompt_ids) != prompts[i]:
                raise ValueError(f"generate_batch result {i} (max_batch={mb}, chunk={ch}) holds another prompt: "
                                 f"{len(res.prompt_ids)} tokens for {len(prompts[i])}")
            b = checked(Outcome.of(res, f"prompt {i} in batch {mb}:{ch}"), f"prompt {i} in batch {mb}:{ch}")
            del res
            a = alone[key_of[i]]
            L = kv_length(a.state, kv)
            c = compare(a, b, names, kv)
            row = {"config": ci, "max_batch": mb, "chunk": ch, "index": i, "prompt_len": len(prompts[i]),
                   "new_tokens": news[i], "generated": len(b.ids), "sampling": sampling_dict(sps[i]), **c,
                   "digest": outcome_digest(b, L, kv), "alone_digest": rep.sequences[i]["digest"],
                   "batch_kv_length": kv_length(b.state, kv), "replay": None}
            if key_of[i] in replayed:
                row["replay"] = compare(replayed[key_of[i]], b, names, kv)
            rows.append(row)
            del b
        rep.rows += rows
        summary = {"config": ci, "max_batch": mb, "chunk": ch, "slots": stats.get("slots"),
                   "pool_length": stats.get("pool_length"), "chunk_used": stats.get("chunk"),
                   "steps": stats.get("steps", {}), "seconds": secs,
                   "generated_tokens": stats.get("generated_tokens"), "rows": len(rows),
                   "rows_equal": sum(row_ok(r) for r in rows), "failures": sum(not row_ok(r) for r in rows),
                   "equal_ids": sum(bool(r["equal_ids"]) for r in rows),
                   "equal_logprobs": sum(bool(r["equal_logprobs"]) for r in rows),
                   "equal_state": sum(bool(r["equal_state"]) for r in rows),
                   "replay_rows": sum(r["replay"] is not None for r in rows),
                   "replay_equal": sum(r["replay"] is not None and equal(r["replay"]) for r in rows)}
        rep.configs.append(summary)
        rep.wall_seconds = time.time() - t_start
        say(format_config(summary))
        for r in rows:
            if not row_ok(r):
                say(f"  prompt {r['index']} ({r['prompt_len']} tokens, {r['new_tokens']} new, "
                    f"{'greedy' if r['sampling']['temperature'] == 0 else 'sampled'}): {_what_differs(r)}")
        if on_progress is not None:
            on_progress(rep)
    rep.wall_seconds = time.time() - t_start
    return rep


def _what_differs(c: dict) -> str:
    parts = []
    if not c["equal_ids"]:
        parts.append(f"ids from position {c['first_token_diff']}")
    if not c["equal_logprobs"]:
        parts.append(f"logprob bytes from position {c['first_token_diff']}")
    if not c["equal_state"]:
        at = f" at position {c['first_state_diff_pos']}" if c["first_state_diff_pos"] is not None else ""
        parts.append(f"state {c['first_state_diff']}{at}")
    if not c["equal_finish"]:
        parts.append("finish reason")
    if c.get("replay") is not None and not equal(c["replay"]):
        parts.append(f"vs replay alone: {_what_differs(c['replay'])}")
    return ", ".join(parts) or "equal"
