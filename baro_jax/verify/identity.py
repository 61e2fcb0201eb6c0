"""The identity gate: batched prefill must give the bytes of replay (the decode step once per
prompt token).

For every prompt, the replay arm runs once; then, for every chunk size, a batched arm. After
the prompt each batched arm must equal the replay arm in every state leaf (KV rows, conv
window, delta state), in the last position's logits and in the greedy tokens generated after
it, all compared as bytes. Each replay arm also gets a digest (digests.arm_digest) that
another run's report can be checked against: how tier mode under a small device limit, or N
devices, is compared with a resident one-device run that cannot load in the same process.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable

import numpy as np

from ..shapes import state_length
from .digests import arm_digest, first_diff, host_leaves, same_bytes, state_names
from .records import echo

TABLE_HEADER = f"{'prompt':>8} {'len':>6} {'chunk':>6} {'state':>8} {'logits':>7} {'tokens':>7}  first diff"


def greedy_tokens(eng, logits, state, pos: int, n: int) -> list[int]:
    """n greedy tokens from `logits` (the last prompt position's) through eng.decode_step; the
    state is donated."""
    from baro_jax.sampling import greedy

    out = []
    for i in range(n):
        t = int(greedy(logits))
        out.append(t)
        if i + 1 < n:
            logits, state = eng.decode_step(t, state, pos + i)
    return out


def run_arm(eng, ids, mode: str, chunk: int | None, new_tokens: int) -> dict:
    """One arm: prefill `ids` ("batch" in chunks of `chunk`, or "replay"), then new_tokens
    greedy tokens. Returns {"state": host leaves after the prompt, "logits": the last prompt
    position's, "tokens", "seconds": the prefill's}."""
    pre = eng.prefill(ids, mode, chunk, n_new=new_tokens)
    logits = np.asarray(pre.logits)
    st = host_leaves(pre.state)  # copied before the greedy tokens donate the state
    toks = greedy_tokens(eng, pre.logits, pre.state, len(ids), new_tokens)
    return {"logits": logits, "state": st, "tokens": toks, "seconds": pre.seconds}


def digest(arm: dict) -> str:
    """The digest of a run_arm result."""
    return arm_digest(arm["state"], arm["logits"], arm["tokens"])


def compare(ref: dict, got: dict, names: list[str]) -> dict:
    """How a batched arm compares with the replay arm: state_equal, first_state_diff (a leaf
    name), logits_equal, tokens_equal, and max_abs_logit_diff when the logits differ (a size for
    the report, never a tolerance)."""
    d = first_diff(ref["state"], got["state"], names)
    same_logits = same_bytes(ref["logits"], got["logits"])
    out = {"state_equal": d is None, "first_state_diff": d, "logits_equal": same_logits,
           "tokens_equal": list(ref["tokens"]) == list(got["tokens"])}
    if not same_logits:
        a, b = np.asarray(ref["logits"], np.float64), np.asarray(got["logits"], np.float64)
        out["max_abs_logit_diff"] = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")
    return out


def row_ok(row: dict) -> bool:
    return bool(row["state_equal"] and row["logits_equal"] and row["tokens_equal"])


def format_row(row: dict) -> str:
    """One line of the per-prompt table, under TABLE_HEADER."""
    def word(ok):
        return "same" if ok else "DIFF"

    return (f"{row['prompt']:>8} {row['len']:>6} {row['chunk']:>6} {word(row['state_equal']):>8} "
            f"{word(row['logits_equal']):>7} {word(row['tokens_equal']):>7}  {row['first_state_diff'] or ''}")


def read_reference(path: str) -> dict:
    """{(prompt name, length): replay_digest} of another gate report's JSON."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {(r["prompt"], r["len"]): r["replay_digest"] for r in rows if r.get("replay_digest")}


@dataclasses.dataclass
class GateReport:
    """What a gate run found. rows: one dict per (prompt, chunk), the JSON's rows. reference:
    None, or how the replay digests compared with a reference run's."""
    rows: list = dataclasses.field(default_factory=list)
    chunks: list = dataclasses.field(default_factory=list)
    new_tokens: int = 0
    variant: str | None = None
    delta_rule: str | None = None
    mode: str | None = None
    reference: dict | None = None
    wall_seconds: float = 0.0

    @property
    def arm_failures(self) -> int:
        return sum(not row_ok(r) for r in self.rows)

    @property
    def reference_failures(self) -> int:
        return self.reference["prompts_differing"] if self.reference else 0

    @property
    def failures(self) -> int:
        """Batched arms that differ from replay, plus prompts whose replay differs from the reference."""
        return self.arm_failures + self.reference_failures

    @property
    def ok(self) -> bool:
        """Every case identical, at least one case run, and, with a reference, at least one prompt
        compared with it (a reference that matches nothing proves nothing)."""
        compared = self.reference is None or self.reference["prompts_compared"] > 0
        return bool(self.rows) and self.failures == 0 and compared

    def summary(self) -> dict:
        s = {"pass": self.ok, "failures": self.failures, "cases": len(self.rows), "variant": self.variant,
             "delta_rule": self.delta_rule, "mode": self.mode, "chunks": list(self.chunks),
             "new_tokens": self.new_tokens, "wall_seconds": self.wall_seconds}
        if self.reference is not None:
            s["reference"] = dict(self.reference)
        return s

    def to_json(self, **extra) -> dict:
        """{"summary": summary() with `extra` merged in (the caller's description of the run:
        model, backend, provenance, ...), "rows": rows}."""
        return {"summary": {**self.summary(), **extra}, "rows": self.rows}

    def partial_json(self) -> dict:
        """What a run cut short leaves: the rows so far, no verdict."""
        return {"summary": {"pass": None, "partial": True, "cases": len(self.rows)}, "rows": self.rows}


def run_identity_gate(engine_or_factory, prompts: list[dict], chunks, *, new_tokens: int = 64,
                      reference: dict | None = None, reference_file: str | None = None,
                      on_prompt: Callable[[GateReport], None] | None = None,
                      log: Callable[[str], None] | None = echo) -> GateReport:
    """Run the gate on an Engine (or a no-argument callable returning one) over `prompts`
    ([{"name", "ids"}], prompts.load_prompts) at each chunk size.

    reference: {(name, len): replay_digest} (read_reference) that this run's replay digests must
    equal where a prompt is in it; reference_file only names it in the report. on_prompt(report)
    runs after every prompt (to write partial results); log gets the table lines (None: quiet)."""
    eng = engine_or_factory if hasattr(engine_or_factory, "prefill") else engine_or_factory()
    chunks = [int(c) for c in chunks]
    rep = GateReport(chunks=chunks, new_tokens=new_tokens, variant=eng.variant,
                     delta_rule=getattr(eng.cfg, "delta_rule", None), mode=eng.mode)
    if reference is not None:
        rep.reference = {"file": reference_file, "prompts_compared": 0, "prompts_differing": 0}
    say = log or (lambda _msg: None)
    # every case against max_context and the device budget before any work (the checks prefill
    # makes): one that cannot run is refused now, named, not after the cases before it
    for p in prompts:
        n = len(p["ids"])
        for c in [None] + chunks:
            try:
                eng.check_fits(n, new_tokens)
                eng.check_device(state_length(n + new_tokens, eng.cfg.max_context), c or 1)
            except MemoryError as e:
                arm = "the replay" if c is None else f"chunk {c}"
                raise MemoryError(f"identity gate: prompt {p['name']} ({n} tokens) at {arm} does not fit: {e}") from None
    names = state_names(eng.cfg)
    t0 = time.time()
    say(TABLE_HEADER)
    for p in prompts:
        ids = p["ids"]
        ref = run_arm(eng, ids, "replay", None, new_tokens)
        ref_digest = digest(ref)
        matches_ref = None
        if reference is not None and (p["name"], len(ids)) in reference:
            matches_ref = reference[(p["name"], len(ids))] == ref_digest
            rep.reference["prompts_compared"] += 1
            rep.reference["prompts_differing"] += not matches_ref
            if not matches_ref:
                say(f"{p['name']:>8} {len(ids):>6}  replay differs from the reference's")
        for c in chunks:
            got = run_arm(eng, ids, "batch", c, new_tokens)
            row = {"prompt": p["name"], "len": len(ids), "chunk": c, "boundaries_crossed": (len(ids) - 1) // c,
                   **compare(ref, got, names), "replay_seconds": ref["seconds"], "batch_seconds": got["seconds"],
                   "replay_digest": ref_digest, "replay_matches_reference": matches_ref}
            rep.rows.append(row)
            say(format_row(row))
        rep.wall_seconds = time.time() - t0
        if on_prompt is not None:
            on_prompt(rep)
    rep.wall_seconds = time.time() - t0
    return rep
