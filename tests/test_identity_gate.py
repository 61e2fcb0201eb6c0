"""The identity gate (baro_jax.verify.identity): batched prefill == replay, bytes of states,
logits and tokens; and that it sees a difference of one bit."""
import json
import types

import numpy as np
import pytest

import baro_jax
from baro_jax import verify
from baro_jax.verify import identity

from benchmarks.identity import DEFAULT_PROMPTS


@pytest.fixture(scope="module")
def tiny():
    return baro_jax.load("tiny", backend="ordered", progress=False)


def test_identity_gate_ordered_cpu(tiny):
    prompts = verify.select(verify.load_prompts(DEFAULT_PROMPTS, tiny.tokenizer), max_len=300)
    rep = verify.run_identity_gate(tiny, prompts, [7, 16, 37, 64], new_tokens=64, log=None)
    assert rep.ok, [r for r in rep.rows if not identity.row_ok(r)]
    assert rep.failures == 0 and len(rep.rows) >= 23 * 4
    # the prompt set must cross one and several chunk boundaries for every chunk size
    for c in (7, 16, 37, 64):
        crossed = {r["boundaries_crossed"] for r in rep.rows if r["chunk"] == c}
        assert 1 in crossed and max(crossed) >= 3
    # one replay digest per prompt, shared by its chunk rows
    by_prompt = {}
    for r in rep.rows:
        by_prompt.setdefault((r["prompt"], r["len"]), set()).add(r["replay_digest"])
    assert all(len(d) == 1 for d in by_prompt.values())
    js = rep.to_json(model="tiny")
    assert js["summary"]["pass"] and js["summary"]["model"] == "tiny" and js["rows"] is rep.rows


def test_identity_gate_with_the_packed_gdn_projection(monkeypatch):
    """BARO_GDN_PACK16: prefill chunks of 64 rows and more (auto) or every call (all) hand the conv
    its channels as bf16 packed in the projection; the bytes of every state, logit and token stay
    those of replay without it (off for the replay's one-row calls under auto)."""
    from baro_jax import ops_ordered
    h, w = np.zeros((64, 8), np.float32).astype("bfloat16"), np.zeros((12, 8), np.float32).astype("bfloat16")
    for mode, rows, packs in (("off", 64, False), ("auto", 63, False), ("auto", 64, True), ("all", 1, True)):
        monkeypatch.setenv("BARO_GDN_PACK16", mode)
        assert ops_ordered.gdn_projection(h[:rows], w, 8)[1] is packs, (mode, rows)
    for mode in ("auto", "all"):
        monkeypatch.setenv("BARO_GDN_PACK16", mode)
        eng = baro_jax.load("tiny", backend="ordered", progress=False)
        prompts = verify.select(verify.load_prompts(DEFAULT_PROMPTS, eng.tokenizer), max_len=200)
        rep = verify.run_identity_gate(eng, prompts, [64, 100], new_tokens=8, log=None)
        assert rep.ok, (mode, [r for r in rep.rows if not identity.row_ok(r)])
        assert max(r["boundaries_crossed"] for r in rep.rows) >= 1


def test_identity_gate_detects_differences(bench_script, tmp_path):
    """The xla backend is not row-invariant: the command line must say so and exit 1."""
    out = tmp_path / "x.json"
    r = bench_script("identity", "--model", "tiny", "--backend", "xla", "--chunks", "16", "--max-len", "70",
                     "--new-tokens", "4", "--json", out)
    res = json.loads(out.read_text())
    assert r.returncode == 1, r.stdout + r.stderr
    assert not res["summary"]["pass"] and res["summary"]["failures"] >= 1 and "FAIL" in r.stdout
    assert any(r["first_state_diff"] for r in res["rows"])
    assert {"commit", "device", "backend", "prompts_file"} <= set(res["summary"])


# ----------------------------------------------------------------------------- one bit

class FlipEngine:
    """A stand-in engine: replay and batch give the same arrays, except that batch at chunk
    `flip_chunk` flips bit 0 of one byte of the state's L1.v ("state") or of the smallest
    logit ("logits": the argmax, so the tokens, stay)."""
    V = 8

    def __init__(self, what, flip_chunk=5):
        self.what, self.flip_chunk = what, flip_chunk
        self.cfg = types.SimpleNamespace(layer_types=["linear_attention", "full_attention"], delta_rule="token",
                                         max_context=4096)
        self.variant, self.mode = None, "resident"

    def check_fits(self, n_prompt, n_new=0):  # the gate's checks before any work: everything fits here
        pass

    def check_device(self, state_len, chunk=0):
        pass

    def prefill(self, ids, mode, chunk, n_new=0):
        rng = np.random.default_rng(len(ids))
        st = {"L0": {"conv": rng.normal(size=(3, 4)).astype(np.float32),
                     "ssm": rng.normal(size=(2, 4, 4)).astype(np.float32)},
              "L1": {"k": rng.normal(size=(16, 2)).astype(np.float32),
                     "v": rng.normal(size=(16, 2)).astype(np.float32)}}
        logits = np.linspace(0, 1, self.V, dtype=np.float32)
        logits[0] = 0.25  # a normal float: its lowest bit is a difference of ~3e-8
        if mode == "batch" and chunk == self.flip_chunk:
            target = st["L1"]["v"] if self.what == "state" else logits
            target.view(np.uint8)[0] ^= 1
        return types.SimpleNamespace(logits=logits, state=st, seconds=0.0)

    def decode_step(self, token, state, pos):
        logits = np.zeros(self.V, np.float32)
        logits[(pos * 3) % self.V] = 1.0
        return logits, state


@pytest.mark.parametrize("what", ["state", "logits"])
def test_one_flipped_bit_fails_its_rows_only(what):
    eng = FlipEngine(what)
    prompts = [{"name": "a", "ids": [1, 2, 3, 4, 5, 6]}, {"name": "b", "ids": [7, 8, 9]}]
    rep = verify.run_identity_gate(lambda: eng, prompts, [4, 5], new_tokens=3, log=None)  # a factory works too
    bad = [r for r in rep.rows if not identity.row_ok(r)]
    assert not rep.ok and rep.failures == len(bad) == 2 and {r["chunk"] for r in bad} == {5}
    for r in bad:
        assert r["tokens_equal"]
        if what == "state":
            assert r["first_state_diff"] == "L1.v" and not r["state_equal"] and r["logits_equal"]
        else:
            assert r["state_equal"] and not r["logits_equal"]
            assert 0 < r["max_abs_logit_diff"] < 1e-7  # one low mantissa bit: allclose would have passed it
    assert all(identity.row_ok(r) for r in rep.rows if r["chunk"] == 4)
    assert rep.to_json()["summary"]["pass"] is False
    assert verify.run_identity_gate(FlipEngine(what, flip_chunk=None), prompts, [4, 5], new_tokens=3, log=None).ok


def test_compare_sees_tokens_and_leaf_count():
    ref = {"state": [np.zeros(3, np.float32)], "logits": np.ones(4, np.float32), "tokens": [1, 2, 3]}
    assert identity.row_ok({**identity.compare(ref, dict(ref), ["L0.k"])})
    c = identity.compare(ref, {**ref, "tokens": [1, 2, 4]}, ["L0.k"])
    assert c["state_equal"] and c["logits_equal"] and not c["tokens_equal"]
    c = identity.compare(ref, {**ref, "state": ref["state"] + [np.zeros(1)]}, ["L0.k"])
    assert not c["state_equal"] and c["first_state_diff"] == "leaf 1"
    neg = {**ref, "state": [-np.zeros(3, np.float32)]}  # -0.0 == 0.0 as numbers, not as bytes
    assert identity.compare(ref, neg, ["L0.k"])["first_state_diff"] == "L0.k"


def test_reference_digests_fail_and_an_empty_match_is_no_pass(tmp_path):
    eng = FlipEngine("state", flip_chunk=None)
    prompts = [{"name": "a", "ids": [1, 2, 3]}]
    one = verify.run_identity_gate(eng, prompts, [2], new_tokens=2, log=None)
    path = tmp_path / "one.json"
    path.write_text(json.dumps(one.to_json()))
    ref = verify.read_reference(str(path))
    assert ref == {("a", 3): one.rows[0]["replay_digest"]}
    assert verify.run_identity_gate(eng, prompts, [2], new_tokens=2, reference=ref, log=None).ok
    wrong = {("a", 3): "0" * 64}
    rep = verify.run_identity_gate(eng, prompts, [2], new_tokens=2, reference=wrong, log=None)
    assert not rep.ok and rep.failures == 1 and rep.arm_failures == 0
    assert rep.rows[0]["replay_matches_reference"] is False
    other = {("b", 3): one.rows[0]["replay_digest"]}  # nothing of this run in it
    rep = verify.run_identity_gate(eng, prompts, [2], new_tokens=2, reference=other, log=None)
    assert rep.failures == 0 and not rep.ok and rep.to_json()["summary"]["reference"]["prompts_compared"] == 0


def _budget_for_chunk(chunk_fits: int, n: int):
    """A device budget (GiB) under which tiny-random's resident prefill of an n-token request fits at
    chunk_fits rows but not at 4096."""
    import jax.numpy as jnp

    from baro_jax import budget

    cfg = baro_jax.preset("tiny-random")
    need = budget.check_resident(cfg, jnp.bfloat16, None, n, chunk=chunk_fits)
    return budget.budget_gb_for(need + (1 << 16))


def test_identity_gate_refuses_a_case_that_cannot_fit_before_any_work(monkeypatch):
    """A chunk the device budget cannot hold beside a prompt is refused before the first prefill,
    naming the prompt, its length and the chunk (not after the cases before it have run)."""
    eng = baro_jax.load("tiny-random", backend="xla", device_budget_gb=_budget_for_chunk(16, 1024), progress=False)
    calls = []
    monkeypatch.setattr(eng, "prefill", lambda *a, **k: calls.append(a))
    prompts = [{"name": "p00", "ids": list(range(1, 11))}, {"name": "p01", "ids": list(range(1, 41))}]
    with pytest.raises(MemoryError, match=r"^identity gate: prompt p00 \(10 tokens\) at chunk 4096 does not fit: "
                                          r"resident mode needs .* activations at chunk 4096"):
        verify.run_identity_gate(eng, prompts, [16, 4096], new_tokens=4, log=None)
    assert calls == []


def test_identity_command_line_says_in_one_line_what_does_not_fit(bench_script):
    r = bench_script("identity", "--model", "tiny-random", "--backend", "xla", "--chunks", "16,4096",
                     "--device-budget-gb", _budget_for_chunk(16, 1024), "--max-len", 40, "--new-tokens", 4,
                     timeout=300)
    assert r.returncode == 2, (r.returncode, r.stdout[-800:], r.stderr[-1500:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: identity gate: prompt ") and "at chunk 4096 does not fit" in err[0], \
        r.stderr[-1500:]
    assert "Traceback" not in r.stderr
