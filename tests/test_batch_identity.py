"""The identity gate's many-sequence axis (baro_jax.verify.batch_identity): every sequence of
generate_batch equals its run alone and its replay alone, in the bytes of ids, logprobs and final
state, with arrivals staggered; and the comparison sees a difference of one bit."""
import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import baro_jax
from baro_jax import Sampling
from baro_jax.verify import batch_identity as bi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNKS = (16, 32)
LONG = 1021  # with 8 new tokens past 1024 positions: the pool's KV (2048) is longer than the short ones' alone (1024)


@pytest.fixture(scope="module")
def eng():
    return baro_jax.load("tiny", backend="ordered", progress=False)


def samplings(n):
    """Half greedy; the sampled half in turn top_p over the vocabulary (the row ranked whole), a
    plain temperature and top_k 20 with top_p."""
    kinds = (dict(top_p=0.95), dict(), dict(top_k=20, top_p=0.95))
    return [Sampling() if i % 2 == 0 else Sampling(temperature=0.8, seed=1000 + i, **kinds[(i // 2) % 3])
            for i in range(n)]


def test_each_sequence_equals_alone_staggered(eng):
    lengths = bi.length_mix(11, 3 * 32 + 4, CHUNKS, seed=0) + [LONG]
    assert {1, 16, 17, 32, 33, 49, 97, 100} <= set(lengths)  # 1 token, boundaries, one past, several chunks
    n = len(lengths)
    news = bi.new_token_mix(n, 1, 8, seed=0)
    news[-1] = 8
    prompts = bi.random_prompts(lengths, eng.cfg.vocab_size, seed=0)
    replay = bi.spread(range(n), lengths, 3, max_len=100)
    assert len(replay) == 3 and 1 in [lengths[i] for i in replay]
    rep = bi.run_batch_identity(eng, prompts, news, samplings(n), [(4, 16), (n, 32)], replay=replay, log=None)
    s = rep.summary()
    assert rep.ok and s["pass"], [r for r in rep.rows if not bi.row_ok(r)]
    assert s["rows"] == s["rows_equal"] == 2 * n and s["equal_state"] == 2 * n
    assert s["replay_rows"] == s["replay_rows_equal"] == 6 and s["replay_equal_alone"] == 3
    c4, cn = rep.configs
    assert c4["slots"] == 4 and cn["slots"] == n  # 4 slots for 12 sequences: they join as others finish
    assert c4["pool_length"] == cn["pool_length"] == 2048 and c4["steps"]["decode"] > 0
    by_index = {q["index"]: q for q in rep.sequences}
    assert by_index[n - 1]["kv_length"] == 2048 and by_index[0]["kv_length"] == 1024
    for r in rep.rows:  # the digests agree over the positions both hold
        assert r["digest"] == r["alone_digest"] == by_index[r["index"]]["digest"]
        assert r["batch_kv_length"] == 2048 and r["generated"] == r["new_tokens"]
    sampled = [r for r in rep.rows if r["sampling"]["temperature"] > 0]
    assert len(sampled) == n and len({r["sampling"]["seed"] for r in sampled}) == n // 2
    js = rep.to_json(model="tiny")
    assert js["summary"]["pass"] and js["summary"]["model"] == "tiny" and js["rows"] is rep.rows
    json.dumps(js)  # plain JSON all through


# ----------------------------------------------------------------------------- one bit

@pytest.fixture(scope="module")
def pair(eng):
    """(alone, in a batch) outcomes of one sampled prompt, the batch's KV longer than alone's."""
    prompts = bi.random_prompts([21, LONG], eng.cfg.vocab_size, seed=5)
    sp = Sampling(temperature=0.8, top_p=0.95, seed=7)
    a = eng.generate(prompts[0], 6, sampling=sp, logprobs=0, keep_state=True, stop_at_eos=False)
    got = eng.generate_batch(prompts, [6, 8], sampling=[sp, Sampling()], logprobs=0, max_batch=2, chunk=16,
                             stop_at_eos=False, keep_states=True)
    return bi.Outcome.of(a, "alone"), bi.Outcome.of(got[0], "batch")


def altered(o, **parts):
    out = copy.deepcopy(o)
    for k, v in parts.items():
        setattr(out, k, v)
    return out


def flip(a, index):
    a = a.copy()
    a.reshape(-1).view(np.uint8)[index] ^= 1
    return a


def test_compare_sees_one_bit(eng, pair):
    names, kv = bi.state_names(eng.cfg), bi.kv_flags(eng.cfg)
    ref, got = pair
    assert got.state[names.index("L3.k")].shape[0] == 2048 > ref.state[names.index("L3.k")].shape[0] == 1024
    assert bi.equal(bi.compare(ref, got, names, kv))

    c = bi.compare(ref, altered(got, logprobs=flip(got.logprobs, 3 * 4)), names, kv)  # the lowest bit of logprob 3
    assert not c["equal_logprobs"] and c["equal_ids"] and c["first_token_diff"] == 3 and not bi.equal(c)

    c = bi.compare(ref, altered(got, ids=got.ids[:4] + [got.ids[4] ^ 1] + got.ids[5:]), names, kv)
    assert not c["equal_ids"] and c["first_token_diff"] == 4

    k = names.index("L3.k")
    row = got.state[k][0].nbytes  # bytes per position
    st = list(got.state)
    st[k] = flip(st[k], 19 * row + 5)
    c = bi.compare(ref, altered(got, state=st), names, kv)
    assert not c["equal_state"] and c["first_state_diff"] == "L3.k" and c["first_state_diff_pos"] == 19

    st = list(got.state)
    st[k] = flip(st[k], 1500 * row)  # a position the run alone does not hold
    assert bi.equal(bi.compare(ref, altered(got, state=st), names, kv))

    s = names.index("L0.ssm")
    st = list(got.state)
    st[s] = flip(st[s], st[s].nbytes - 1)  # the top byte of the last delta-state float
    c = bi.compare(ref, altered(got, state=st), names, kv)
    assert c["first_state_diff"] == "L0.ssm" and c["first_state_diff_pos"] is None

    assert not bi.compare(ref, altered(got, finish="stop"), names, kv)["equal_finish"]


class FlipOneState:
    """The engine, except that generate_batch's result `which` comes back with one bit of its
    delta state flipped."""

    def __init__(self, eng, which):
        self._eng, self._which = eng, which

    def __getattr__(self, name):
        return getattr(self._eng, name)

    def generate_batch(self, *args, **kwargs):
        out = self._eng.generate_batch(*args, **kwargs)
        st = [dict(layer) for layer in out[self._which].state]
        st[1]["ssm"] = flip(np.asarray(st[1]["ssm"]), 0)
        out[self._which].state = tuple(st)
        return out


def test_gate_fails_on_a_flipped_bit(eng):
    prompts = bi.random_prompts([3, 18, 9], eng.cfg.vocab_size, seed=2)
    lines = []
    rep = bi.run_batch_identity(FlipOneState(eng, 1), prompts, 4, samplings(3), [(2, 16)], replay=[1], log=lines.append)
    assert not rep.ok and rep.failures == 1 and rep.summary()["pass"] is False
    bad = [r for r in rep.rows if not bi.row_ok(r)]
    assert [r["index"] for r in bad] == [1]
    r = bad[0]
    assert r["equal_ids"] and r["equal_logprobs"] and not r["equal_state"] and r["first_state_diff"] == "L1.ssm"
    assert not r["replay"]["equal_state"] and r["digest"] != r["alone_digest"]
    assert any("FAIL" in x for x in lines) and any("state L1.ssm" in x for x in lines)


# ----------------------------------------------------------------------------- inputs

def test_inputs_and_their_errors():
    a = bi.length_mix(20, 500, [32, 256], seed=3)
    assert a == bi.length_mix(20, 500, [32, 256], seed=3) and len(set(a)) == 20
    assert {1, 500, 32, 33, 97, 256, 257} <= set(a) and 769 not in a and max(a) == 500
    few = bi.length_mix(4, 3, [2])
    assert len(few) == 4 and set(few) == {1, 2, 3}  # more sequences than lengths: repeats
    assert bi.parse_configs("n/4:32, n:auto,1:64,auto:8", 12) == [(3, 32), (12, None), (1, 64), (None, 8)]
    assert bi.parse_configs("n/16:32", 6) == [(1, 32)]
    for spec, msg in [("16", "expected MAX_BATCH:CHUNK"), ("x:3", "MAX_BATCH is an integer"),
                      ("0:3", "must be >= 1"), ("n/0:4", "MAX_BATCH is an integer"), ("", "no batch configuration")]:
        with pytest.raises(ValueError, match=msg):
            bi.parse_configs(spec, 8)
    news = bi.new_token_mix(10, 2, 9, seed=1)
    assert news[:2] == [9, 2] and all(2 <= x <= 9 for x in news)
    assert bi.spread(range(6), [5, 1, 900, 40, 3, 2000], 3, max_len=1000) == [0, 1, 2]  # lengths 5, 1, 900
    with pytest.raises(ValueError, match="replay indices \\[5\\] are outside the 2 prompts"):
        bi.run_batch_identity(None, [[1], [2]], 1, None, [(1, 1)], replay=[5])
    with pytest.raises(ValueError, match="new_tokens has 3 entries for 2 prompts"):
        bi.run_batch_identity(None, [[1], [2]], [1, 2, 3], None, [(1, 1)])


# ----------------------------------------------------------------------------- the command line

def test_command_line_on_tiny(tmp_path):
    out = tmp_path / "b.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "batch_identity.py"), "--n", "6",
                        "--max-len", "40", "--new-tokens", "4", "--configs", "n/3:16,n:16", "--replay", "2",
                        "--shared", "2", "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    s = res["summary"]
    # the last two start as the longest before them does: with a slot each from the start (6 slots),
    # the pool copied the state of their common tokens instead of prefilling them
    assert s["shared"] == 2 and res["configs"][1]["steps"]["forks"] == 2, res["configs"]
    assert s["pass"] is True and s["rows"] == 12 and s["replay_rows"] == 4 and s["config_list"] == [[2, 16], [6, 16]]
    assert {"device", "commit", "date", "host", "jax"} <= set(s) and s["model"] == "tiny"
    assert len(res["sequences"]) == 6 and all(row["equal_state"] for row in res["rows"])
    assert sum(x.startswith("max_batch=") for x in r.stdout.splitlines()) == 2 and "PASS: 12/12" in r.stdout


def test_a_configuration_that_cannot_fit_is_refused_before_any_run(monkeypatch):
    """A (max_batch, chunk) whose pool the device budget cannot hold is refused before the runs
    alone, naming the configuration and what does not fit (not after the configurations before it)."""
    from baro_jax import budget
    from baro_jax.settings import DEFAULT_KV_PAGE

    from baro_jax.shapes import state_length

    eng = baro_jax.load("tiny-random", backend="ordered", progress=False)
    prompts = [list(range(1, 1 + n)) for n in (5, 30, 12, 40, 7, 22, 3, 9)]
    L = state_length(40 + 4, eng.cfg.max_context)  # the pool's positions per slot
    found = next((float(gb) for gb in np.linspace(1.0, 1.0025, 25001)
                  if 1 <= budget.batch_slots(eng.cfg, eng.dtype, float(gb), L, 16, 8, page=DEFAULT_KV_PAGE)[0] < 8), None)
    assert found is not None
    eng.runner.settings = eng.runner.settings.replace(device_budget_gb=found)
    runs = []
    monkeypatch.setattr(eng, "generate", lambda *a, **k: runs.append(a))
    monkeypatch.setattr(eng, "generate_batch", lambda *a, **k: runs.append(a))
    with pytest.raises(MemoryError, match=r"^batch identity: configuration max_batch=8 chunk=16 does not fit: "
                                          r"max_batch 8 slots .* at most [1-7] do$"):
        bi.run_batch_identity(eng, prompts, 4, None, [(1, 16), (8, 16)], log=None)
    assert runs == []
