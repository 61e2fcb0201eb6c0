"""Teacher-forced agreement: an order-changing variant (baro_jax/variants.py) judged against the
product's greedy replay, by a bar fixed here before anything runs.

Per prompt (N new tokens):
- reference: the product's replay (ordered backend, the decode step per prompt token), then N
  greedy tokens, keeping the logits that chose each of them;
- control: the product's batched path, teacher-forced on prompt + the first N-1 reference
  tokens in chunks (as batched prefill runs them, on the reference's state length), every
  row's logits; the N scored positions are n-1 .. n+N-2;
- each candidate: the same teacher-forced forward with the variant's ops on the same weights.
Agreement is the percent of scored positions (over all prompts) whose argmax is the reference
token. The control must read exactly 100.0, or the harness is broken and no candidate number
means anything.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .records import echo

BAR = 99.0  # percent of teacher-forced positions whose argmax must equal the reference token

TABLE_HEADER = f"{'prompt':>10} {'len':>5} {'arm':>12} {'agree%':>7} {'mean|d|':>9} {'max|d|':>9} {'first div':>9}"


def reference(eng, ids, n_new: int):
    """The product's replay of ids, then n_new greedy tokens: (tokens, logits [n_new, V] that
    chose them, the KV length of the state the replay ran on)."""
    from baro_jax.sampling import greedy

    pre = eng.prefill(ids, "replay", n_new=n_new)
    logits, state = pre.logits, pre.state
    state_len = eng.check_state(state, "reference")
    toks, rows = [], []
    for i in range(n_new):
        rows.append(np.asarray(logits))
        toks.append(int(greedy(logits)))
        if i + 1 < n_new:
            logits, state = eng.decode_step(toks[-1], state, len(ids) + i)
    return toks, np.stack(rows), state_len


def teacher_forced(eng, ids, ref_tokens, chunk, state_len):
    """Logits [N, V] at the N scored positions: prompt + ref_tokens[:-1] through eng's batched path."""
    seq = list(ids) + list(ref_tokens[:-1])
    return eng.forced_logits(seq, chunk=chunk, state_len=state_len, start=len(ids) - 1)


def score(logits, ref_tokens, ref_logits) -> dict:
    """One arm on one prompt: matches, positions, agreement (percent), mean and max |logit -
    reference logit|, logits_identical (bytes), first_divergence (the first scored position
    whose argmax is not the reference token, None if none) with the reference's top-two margin
    and both tokens there (a near-tie flips easily)."""
    logits, ref_logits = np.asarray(logits), np.asarray(ref_logits)
    if logits.shape != ref_logits.shape or logits.shape[0] != len(ref_tokens):
        raise ValueError(f"scored logits {logits.shape} against reference logits {ref_logits.shape} "
                         f"and {len(ref_tokens)} tokens")
    pred = np.argmax(logits, axis=-1)
    ref = np.asarray(ref_tokens)
    match = pred == ref
    bad = np.flatnonzero(~match)
    d = np.abs(logits.astype(np.float64) - ref_logits.astype(np.float64))
    row = {"matches": int(match.sum()), "positions": int(match.size),
           "agreement": 100.0 * float(match.mean()),
           "mean_abs_logit_diff": float(d.mean()), "max_abs_logit_diff": float(d.max()),
           "logits_identical": logits.dtype == ref_logits.dtype and logits.tobytes() == ref_logits.tobytes(),
           "first_divergence": int(bad[0]) if bad.size else None}
    if bad.size:
        top2 = np.sort(ref_logits[bad[0]])[-2:]
        row["ref_margin_at_first_divergence"] = float(top2[1] - top2[0])
        row["token_at_first_divergence"] = {"reference": int(ref[bad[0]]), "candidate": int(pred[bad[0]])}
    return row


def summarise(rows: list[dict]) -> dict:
    """An arm over all prompts: agreement weighted by positions (not a mean of per-prompt
    percentages), the position-weighted mean |d|, the max |d|, how many prompts diverged."""
    m = sum(r["matches"] for r in rows)
    n = sum(r["positions"] for r in rows)
    total = sum(r["positions"] * r["mean_abs_logit_diff"] for r in rows)
    div = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    return {"agreement": 100.0 * m / n if n else float("nan"), "matches": m, "positions": n,
            "mean_abs_logit_diff": total / n if n else float("nan"),
            "max_abs_logit_diff": max((r["max_abs_logit_diff"] for r in rows), default=float("nan")),
            "logits_identical": all(r["logits_identical"] for r in rows),
            "prompts_diverged": len(div),
            "earliest_divergence": min(div, default=None)}


def parse_candidates(text: str) -> list[str]:
    """Comma-separated variant names, each checked; the product itself ("none") is refused."""
    from baro_jax import variants

    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ValueError(f"--candidate needs at least one of {', '.join(variants.VARIANTS)}")
    for c in names:
        if variants.check(c) is None:
            raise ValueError(f"--candidate {c!r} is the product itself, not a variant; "
                             f"choose from {', '.join(variants.VARIANTS)}")
    return names


def make_arms(eng, candidates: list[str]) -> dict:
    """{"control": eng, name: an Engine on eng's weights (no second copy) with the variant's ops}."""
    return {"control": eng, **{c: eng.with_variant(c) for c in candidates}}


def _format(name: str, n: int, arm: str, r: dict) -> str:
    fd = "-" if r["first_divergence"] is None else str(r["first_divergence"])
    return (f"{name:>10} {n:>5} {arm:>12} {r['agreement']:>7.2f} {r['mean_abs_logit_diff']:>9.2e} "
            f"{r['max_abs_logit_diff']:>9.2e} {fd:>9}")


class Agreement:
    """The harness's running state over prompts: arms {"control": the product's engine, name:
    variant engine}, the rows scored so far, per-arm seconds. score_prompt adds one prompt;
    to_json says what holds so far."""

    def __init__(self, arms: dict, new_tokens: int, chunk: int | None = None, *, bar: float = BAR,
                 log: Callable[[str], None] | None = echo):
        if "control" not in arms:
            raise ValueError("the arms need a 'control': the product's own engine")
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.arms, self.new_tokens, self.chunk, self.bar = arms, new_tokens, chunk, bar
        self.candidates = [a for a in arms if a != "control"]
        self.rows: list[dict] = []
        self.per_arm = {a: [] for a in arms}
        self.seconds = {a: 0.0 for a in arms}
        self.log = log or (lambda _msg: None)
        self.t_start = time.time()

    def score_prompt(self, name: str, ids) -> dict:
        """The reference on ids, then every arm teacher-forced on it; the prompt's row."""
        eng = self.arms["control"]
        t0 = time.perf_counter()
        # every arm runs on the reference's state length: the forced forward is the product's
        # own computation only on the product's own state shape
        ref_tokens, ref_logits, L = reference(eng, ids, self.new_tokens)
        row = {"prompt": name, "len": len(ids), "reference_seconds": time.perf_counter() - t0,
               "reference_tokens": ref_tokens, "arms": {}}
        for a, e in self.arms.items():
            t0 = time.perf_counter()
            r = score(teacher_forced(e, ids, ref_tokens, self.chunk, L), ref_tokens, ref_logits)
            dt = time.perf_counter() - t0
            self.seconds[a] += dt
            r["seconds"] = dt
            row["arms"][a] = r
            self.per_arm[a].append(r)
            self.log(_format(name, len(ids), a, r))
        self.rows.append(row)
        return row

    @property
    def control(self) -> dict:
        return summarise(self.per_arm["control"])

    @property
    def harness_ok(self) -> bool:
        """The control picked every reference token at every scored position (and there was one)."""
        c = self.control
        return c["positions"] > 0 and c["agreement"] == 100.0

    def candidate(self, a: str) -> dict:
        s = {**summarise(self.per_arm[a]), "seconds": self.seconds[a]}
        s["candidate_agreement"] = s["agreement"]
        s["passes_bar"] = s["agreement"] >= self.bar
        s["overridden_ops"] = list(self.arms[a].ops.overridden)
        return s

    def all_pass(self, partial: bool = False) -> bool:
        return (not partial) and self.harness_ok and all(self.candidate(a)["passes_bar"] for a in self.candidates)

    def control_divergences(self) -> list:
        """(prompt, first divergent position) of every prompt where the control diverged."""
        return [(r["prompt"], r["arms"]["control"]["first_divergence"]) for r in self.rows
                if r["arms"]["control"]["first_divergence"] is not None]

    def to_json(self, partial: bool, config: dict | None = None, provenance: dict | None = None) -> dict:
        """The report: the bar, control and candidate summaries, every row; config (the
        caller's description of the run) merged into the harness's own."""
        from baro_jax import variants

        summ = {a: self.candidate(a) for a in self.candidates}
        cfg = {"reference": "replay, ordered backend, greedy",
               "control": "batched path, ordered backend, teacher-forced",
               **(config or {}), "prompts_done": len(self.rows), "new_tokens": self.new_tokens, "chunk": self.chunk,
               "attention_impl_for_attn_fast": (variants.attention_impl(self.arms["attn-fast"].settings.attn_impl)
                                            if "attn-fast" in self.arms else None),
               # variants keeps no public record of the shapes cuDNN refused: read its list
               "cudnn_fallbacks": list(variants._FALLBACKS),
               "delta_chunk_rows": variants.DELTA_CHUNK}
        return {
            "bar": self.bar,
            "partial": partial,
            "control_agreement": self.control["agreement"],
            "candidate_agreement": {a: summ[a]["agreement"] for a in self.candidates},
            "passes_bar": {a: summ[a]["passes_bar"] for a in self.candidates},
            "all_pass": self.all_pass(partial),
            "harness_ok": self.harness_ok,
            "control": {**self.control, "seconds": self.seconds["control"]},
            "candidates": summ,
            "config": cfg,
            "wall_seconds": time.time() - self.t_start,
            "provenance": provenance or {},
            "rows": self.rows,
        }


def run_agreement(arms: dict, prompts: list[dict], new_tokens: int, chunk: int | None = None, *,
                  harness: Agreement | None = None, on_prompt: Callable[[Agreement], None] | None = None,
                  log: Callable[[str], None] | None = echo) -> Agreement:
    """Score every prompt ([{"name", "ids"}]) on every arm (make_arms); on_prompt(harness) after
    each one (to write partial results). harness: one made earlier (its clock started then)."""
    h = harness or Agreement(arms, new_tokens, chunk, log=log)
    h.log(TABLE_HEADER)
    for p in prompts:
        h.score_prompt(p["name"], p["ids"])
        if on_prompt is not None:
            on_prompt(h)
    return h


def prefill_speeds(arms: dict, length: int, *, seed: int = 0, xla_chunk: int = 1024,
                   log: Callable[[str], None] | None = echo) -> dict:
    """Batched prefill tok/s of each arm on one seeded random prompt of `length` tokens, at the
    chunk the product would pick (the xla variant capped at xla_chunk: its jnp MoE is dense);
    one warm run, then the best of two. A failing arm records its error instead of ending the run."""
    import jax

    say = log or (lambda _msg: None)
    base = arms["control"]
    ids = [int(x) for x in np.random.default_rng(seed + length).integers(0, base.cfg.vocab_size, length)]
    out = {"prompt_tokens": length, "arms": {}}
    for a, e in arms.items():
        c = e.pick_chunk(length)
        if a == "xla":
            c = min(c, xla_chunk)
        try:
            secs = []
            for _ in range(3):
                pre = e.prefill(ids, "batch", c)  # a fresh state each time: a prefill donates its state
                jax.block_until_ready(pre.logits)
                secs.append(pre.seconds)
                del pre
            best = min(secs[1:])
            out["arms"][a] = {"chunk": c, "tokens_per_s": length / best, "seconds": best}
            say(f"speed {a:>12}: {length / best:10.1f} tok/s at {length} tokens, chunk {c}")
        except Exception as ex:  # noqa: BLE001  (an arm that cannot run still leaves the others)
            out["arms"][a] = {"chunk": c, "error": f"{type(ex).__name__}: {str(ex)[:300]}"}
            say(f"speed {a:>12}: failed: {out['arms'][a]['error']}")
    ctrl = out["arms"].get("control", {}).get("tokens_per_s")
    for r in out["arms"].values():
        if ctrl and "tokens_per_s" in r:
            r["vs_product"] = r["tokens_per_s"] / ctrl
    return out
