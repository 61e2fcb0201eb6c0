"""Order-changing variants (baro_jax/variants.py) and their judge, baro_jax.verify.agreement
(command line: benchmarks/agreement.py).

The harness runs once per module on the trained `tiny` (2 prompts x 8 tokens, chunk 16 so the
forced forward crosses chunk boundaries); its numbers are printed (run with -s to see them), the
test writes nothing to the repository.
"""
import json

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import baro_jax
from baro_jax import ops_ordered, ops_xla, variants
from baro_jax import verify
from baro_jax.verify import agreement

from benchmarks import agreement as agreement_cli

ARGS = ["--model", "tiny", "--limit", "2", "--new-tokens", "8", "--chunk", "16"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("agreement") / "a.json"
    rc = agreement_cli.main(ARGS + ["--candidate", ",".join(variants.VARIANTS), "--speed-length", "40",
                                    "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_speed_of_every_arm_is_reported(run):
    rc, res = run
    sp = res["speed"]
    assert sp["prompt_tokens"] == 40 and set(sp["arms"]) == {"control", *variants.VARIANTS}
    for a, r in sp["arms"].items():
        assert r["tokens_per_s"] > 0 and r["chunk"] >= 1, (a, r)
    assert sp["arms"]["control"]["vs_product"] == 1.0


def test_control_is_100_and_candidates_give_numbers(run):
    rc, res = run
    assert res["bar"] == agreement.BAR == 99.0
    assert res["control_agreement"] == 100.0 and res["harness_ok"]
    assert res["control"]["logits_identical"] and res["control"]["max_abs_logit_diff"] == 0.0
    for name in variants.VARIANTS:
        c = res["candidates"][name]
        print(f"\n[tiny cpu, 2 prompts x 8 tokens, chunk 16] {name}: agreement {c['candidate_agreement']:.2f}% "
              f"(bar {res['bar']}), mean |d| {c['mean_abs_logit_diff']:.3e}, max |d| {c['max_abs_logit_diff']:.3e}, "
              f"earliest divergence {c['earliest_divergence']}")
        assert 0.0 <= c["candidate_agreement"] <= 100.0
        assert res["candidate_agreement"][name] == c["candidate_agreement"]
        assert res["passes_bar"][name] == (c["candidate_agreement"] >= 99.0)
        assert np.isfinite(c["mean_abs_logit_diff"]) and c["max_abs_logit_diff"] > 0  # the order did change
        assert not c["logits_identical"] and c["overridden_ops"]
    assert rc == (0 if all(res["passes_bar"].values()) else 1)
    assert len(res["rows"]) == 2 and all(len(r["reference_tokens"]) == 8 for r in res["rows"])
    assert "commit" in res["provenance"] and "device" in res["provenance"]
    assert res["config"]["model"] == "tiny" and res["config"]["prompts_done"] == 2 and not res["partial"]


def test_perturbed_control_fails_loudly(monkeypatch, capsys, tmp_path):
    orig = agreement.teacher_forced

    def broken(eng, ids, ref_tokens, chunk, state_len):
        lg = orig(eng, ids, ref_tokens, chunk, state_len)
        if eng.variant is None:  # the control: make its first scored position pick another token
            lg = lg.copy()
            lg[0, (ref_tokens[0] + 1) % lg.shape[1]] = lg[0].max() + 10.0
        return lg

    monkeypatch.setattr(agreement, "teacher_forced", broken)
    rc = agreement_cli.main(ARGS + ["--candidate", "delta-chunk", "--json", str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert rc == 3
    assert "HARNESS BROKEN" in err and "not 100.0" in err
    res = json.loads((tmp_path / "b.json").read_text())
    assert not res["harness_ok"] and not res["all_pass"] and res["control_agreement"] < 100.0


def test_unknown_candidate_names_choices(bench_script):
    r = bench_script("agreement", "--model", "tiny", "--candidate", "fast-everything")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "fast-everything" in r.stderr and all(v in r.stderr for v in variants.VARIANTS)
    assert "agreement bar: 99.0%" in r.stdout


# ----------------------------------------------------------------------------- the arithmetic

def test_score_counts_positions_and_finds_the_first_divergence():
    ref_tokens = [2, 0, 1, 3]
    ref = np.eye(4, dtype=np.float32)[ref_tokens] * 5.0  # one-hot at the reference tokens
    ref[2, 3] = 4.5  # a near-tie at position 2
    got = ref.copy()
    got[2, 3] = 6.0  # position 2 flips to token 3
    r = agreement.score(got, ref_tokens, ref)
    assert r["matches"] == 3 and r["positions"] == 4 and r["agreement"] == 75.0
    assert r["first_divergence"] == 2 and r["token_at_first_divergence"] == {"reference": 1, "candidate": 3}
    assert r["ref_margin_at_first_divergence"] == pytest.approx(0.5)
    assert r["max_abs_logit_diff"] == pytest.approx(1.5) and r["mean_abs_logit_diff"] == pytest.approx(1.5 / 16)
    assert not r["logits_identical"]
    same = agreement.score(ref.copy(), ref_tokens, ref)
    assert same["agreement"] == 100.0 and same["logits_identical"] and same["first_divergence"] is None
    with pytest.raises(ValueError, match="scored logits"):
        agreement.score(got[:3], ref_tokens, ref)


def test_summarise_weights_by_positions_not_prompts():
    rows = [{"matches": 1, "positions": 1, "mean_abs_logit_diff": 0.0, "max_abs_logit_diff": 0.0,
             "logits_identical": True, "first_divergence": None},
            {"matches": 0, "positions": 3, "mean_abs_logit_diff": 2.0, "max_abs_logit_diff": 5.0,
             "logits_identical": False, "first_divergence": 0}]
    s = agreement.summarise(rows)
    assert s["agreement"] == 25.0  # 1 of 4 positions, not the mean of 100% and 0%
    assert s["mean_abs_logit_diff"] == 1.5 and s["max_abs_logit_diff"] == 5.0
    assert not s["logits_identical"] and s["prompts_diverged"] == 1 and s["earliest_divergence"] == 0


class ForcedEngine:
    """A stand-in arm whose forced logits pick the reference token except at `wrong` positions."""
    V = 6

    def __init__(self, variant=None, wrong=()):
        self.variant, self.wrong = variant, set(wrong)
        self.ops = type("Ops", (), {"overridden": ("delta",)})()

    def forced_logits(self, seq, chunk=None, state_len=None, start=0):
        out = np.zeros((len(seq) - start, self.V), np.float32)
        for i, p in enumerate(range(start, len(seq))):
            nxt = seq[p + 1] if p + 1 < len(seq) else 5
            out[i, (nxt + (i in self.wrong)) % self.V] = 1.0
        return out


def test_harness_percent_and_bar_on_a_constructed_case(monkeypatch):
    """Reference tokens 1, 2, 3, 5 after each prompt; the candidate misses 1 of 4 positions on
    one prompt and none on the other: 7/8 = 87.5%, under the 99% bar; the control 100%."""
    def fake_reference(eng, ids, n_new):
        toks = [1, 2, 3, 5][:n_new]
        return toks, np.eye(ForcedEngine.V, dtype=np.float32)[toks], 64

    monkeypatch.setattr(agreement, "reference", fake_reference)
    arms = {"control": ForcedEngine(), "delta-chunk": ForcedEngine("delta-chunk", wrong={1})}
    calls = []
    h = agreement.Agreement(arms, 4, log=None)
    h.score_prompt("a", [0, 4])
    arms["delta-chunk"].wrong = set()
    agreement.run_agreement(arms, [{"name": "b", "ids": [3]}], 4, harness=h, on_prompt=calls.append)
    assert calls == [h]
    out = h.to_json(False, {"model": "fake"})
    assert out["control_agreement"] == 100.0 and out["harness_ok"]
    c = out["candidates"]["delta-chunk"]
    assert c["matches"] == 7 and c["positions"] == 8 and c["agreement"] == 87.5
    assert not c["passes_bar"] and not out["all_pass"] and out["passes_bar"] == {"delta-chunk": False}
    assert c["overridden_ops"] == ["delta"] and out["config"]["model"] == "fake"
    assert [r["arms"]["delta-chunk"]["first_divergence"] for r in out["rows"]] == [1, None]
    h.bar = 87.5  # exactly at the bar passes
    assert h.all_pass() and not h.all_pass(partial=True)
    arms["control"].wrong = {0}
    h.score_prompt("c", [2])
    assert not h.harness_ok and h.control_divergences() == [("c", 0)]


# ----------------------------------------------------------------------------- selection

def test_unknown_variant_names_choices(monkeypatch):
    with pytest.raises(ValueError, match="xla, attn-fast, delta-chunk"):
        variants.check("turbo")
    with pytest.raises(ValueError, match="xla, attn-fast, delta-chunk"):
        baro_jax.load("tiny", variant="turbo", progress=False)
    monkeypatch.setenv("BARO_VARIANT", "turbo")  # the environment is read once, by the settings
    with pytest.raises(ValueError, match="BARO_VARIANT.*xla, attn-fast, delta-chunk"):
        baro_jax.load("tiny", progress=False)


def test_api_and_env_select_ops(monkeypatch):
    monkeypatch.delenv("BARO_VARIANT", raising=False)
    assert baro_jax.load("tiny", progress=False).ops is ops_ordered  # off by default
    a = baro_jax.load("tiny", variant="attn-fast", progress=False)
    assert a.variant == "attn-fast" and a.backend == "ordered" and a.ops is variants.get_ops("attn-fast")
    assert a.ops.attention is not ops_ordered.attention
    assert a.ops.delta is ops_ordered.delta and a.ops.matmul is ops_ordered.matmul and a.ops.moe is ops_ordered.moe
    x = variants.get_ops("xla")
    assert all(getattr(x, op) is getattr(ops_xla, op) for op in variants.OP_NAMES)
    monkeypatch.setenv("BARO_VARIANT", "delta-chunk")
    d = baro_jax.load("tiny", progress=False)
    assert d.variant == "delta-chunk" and d.ops.delta is not ops_ordered.delta
    assert d.ops.attention is ops_ordered.attention
    assert baro_jax.load("tiny", variant="none", progress=False).ops is ops_ordered  # explicit off beats the env
    with pytest.raises(ValueError, match="ordered backend"):
        baro_jax.load("tiny", backend="xla", variant="attn-fast", progress=False)


def test_cli_variant(capsys, monkeypatch):
    from baro_jax import generate

    monkeypatch.delenv("BARO_VARIANT", raising=False)
    rc = generate.main(["--prompt", "def f(x):\n", "--max-new-tokens", "3", "--chunk", "16", "--variant",
                        "delta-chunk", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    o = json.loads(out)
    assert o["variant"] == "delta-chunk" and o["backend"] == "ordered" and len(o["generated_ids"]) == 3
    monkeypatch.setenv("BARO_VARIANT", "attn-fast")
    rc = generate.main(["--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--chunk", "16", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["variant"] == "attn-fast"
    rc = generate.main(["--prompt-ids", "1,2,3", "--max-new-tokens", "1", "--variant", "warp", "--json"])
    err = capsys.readouterr().err
    assert rc == 2 and "--variant" in err and "'warp'" in err and all(v in err for v in variants.VARIANTS)


# ----------------------------------------------------------------------------- op contracts

def test_delta_chunk_honours_n_valid_and_matches_ordered():
    """Padded rows leave no trace in the state (bytes), o and state close to the ordered kernel's."""
    rng = np.random.default_rng(0)
    nk, dk, nv, dv, m, n_valid = 2, 16, 4, 16, 37, 29
    C = 2 * nk * dk + nv * dv
    y = jnp.asarray(rng.normal(size=(m, C)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(m, nv)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(m, nv)), jnp.float32)
    A_log = jnp.asarray(np.log(rng.uniform(1, 16, nv)), jnp.float32)
    dt_bias = jnp.asarray(rng.normal(size=nv) * 0.1, jnp.float32)
    S0 = jnp.asarray(rng.normal(size=(nv, dk, dv)) * 0.1, jnp.float32)
    fn = jax.jit(variants.get_ops("delta-chunk").delta, static_argnames=("nk", "dk"))
    o, S = fn(y, b, a, A_log, dt_bias, S0, jnp.int32(n_valid), nk=nk, dk=dk)
    garbage = y.at[n_valid:].set(1e30)  # padded rows hold anything
    o2, S2 = fn(garbage, b.at[n_valid:].set(jnp.nan), a, A_log, dt_bias, S0, jnp.int32(n_valid), nk=nk, dk=dk)
    assert np.asarray(S).tobytes() == np.asarray(S2).tobytes()
    assert np.asarray(o[:n_valid]).tobytes() == np.asarray(o2[:n_valid]).tobytes()
    assert o.shape == (m, nv, dv) and S.shape == (nv, dk, dv) and S.dtype == jnp.float32
    ro, rS = ops_ordered.delta(y, b, a, A_log, dt_bias, S0, jnp.int32(n_valid), nk=nk, dk=dk)
    np.testing.assert_allclose(np.asarray(o[:n_valid]), np.asarray(ro[:n_valid]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(S), np.asarray(rS), rtol=1e-4, atol=1e-5)


def test_attn_fast_cache_semantics():
    """Rows pos+i (i < n_valid) written as ops_xla writes them, nothing else touched; o close to ordered."""
    rng = np.random.default_rng(1)
    H, Hkv, hd, S, m, pos, n_valid = 4, 2, 32, 128, 16, 21, 11
    R2 = hd // 4
    qkv = jnp.asarray(rng.normal(size=(m, (2 * H + 2 * Hkv) * hd)), jnp.float32)
    qn = jnp.asarray(rng.normal(size=hd) * 0.1, jnp.float32)
    kn = jnp.asarray(rng.normal(size=hd) * 0.1, jnp.float32)
    ang = (pos + np.arange(m))[:, None] * 0.5 ** np.arange(R2)[None]
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    kc = jnp.asarray(rng.normal(size=(S, Hkv, hd)), jnp.bfloat16)
    vc = jnp.asarray(rng.normal(size=(S, Hkv, hd)), jnp.bfloat16)
    kc = kc.at[pos + n_valid:].set(jnp.nan)  # never-written rows may hold anything
    vc = vc.at[pos + n_valid:].set(jnp.nan)
    args = (qkv, qn, kn, cos, sin, kc, vc, jnp.int32(pos), jnp.int32(n_valid))
    kw = dict(num_heads=H, num_kv_heads=Hkv, eps=1e-6)
    o, k2, v2 = variants.get_ops("attn-fast").attention(*args, **kw)
    xo, xk, xv = ops_xla.attention(*args, **kw)
    ro, rk, rv = ops_ordered.attention(*args, **kw)
    assert np.asarray(k2).tobytes() == np.asarray(xk).tobytes() and np.asarray(v2).tobytes() == np.asarray(xv).tobytes()
    untouched = np.r_[0:pos, pos + n_valid:S]
    assert np.asarray(k2)[untouched].tobytes() == np.asarray(kc)[untouched].tobytes()
    assert np.asarray(v2)[pos:pos + n_valid].tobytes() == np.asarray(rv)[pos:pos + n_valid].tobytes()
    got = np.asarray(o[:n_valid], np.float32)
    assert np.isfinite(got).all() and o.dtype == jnp.bfloat16 and o.shape == (m, H * hd)
    np.testing.assert_allclose(got, np.asarray(ro[:n_valid], np.float32), rtol=0.05, atol=0.03)
    # decode (m = 1) stays on the ordered kernel: bytes equal
    one = (qkv[:1], qn, kn, cos[:1], sin[:1], kc, vc, jnp.int32(pos), jnp.int32(1))
    for x, y in zip(variants.get_ops("attn-fast").attention(*one, **kw), ops_ordered.attention(*one, **kw)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_speeds_are_on_disk_before_the_first_prompt(tmp_path, monkeypatch):
    """A run cut short inside its first prompt (a device call's time limit) still leaves the
    speeds, which run first, in the JSON, marked partial."""
    out = tmp_path / "cut.json"

    def cut(*a, **k):
        raise KeyboardInterrupt("cut")  # what a time limit's signal looks like to the script

    monkeypatch.setattr(agreement, "reference", cut)
    with pytest.raises(KeyboardInterrupt):
        agreement_cli.main(["--model", "tiny", "--limit", "1", "--new-tokens", "2", "--candidate", "xla",
                        "--speed-length", "20", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["partial"] is True and res["config"]["prompts_done"] == 0
    assert set(res["speed"]["arms"]) == {"control", "xla"}
