"""The small pieces of baro_jax.verify that decide what a report says: byte equality, digests,
state leaf names, prompt files and the written JSON."""
import json
import types

import numpy as np
import pytest

from baro_jax import verify
from baro_jax.verify import digests, records


def test_same_bytes_is_bytes_not_values():
    a = np.array([0.0, 1.0, np.nan], np.float32)
    assert verify.same_bytes(a, a.copy())  # the same NaN bits are the same
    assert not verify.same_bytes(a, np.array([-0.0, 1.0, np.nan], np.float32))
    assert not verify.same_bytes(a, a.astype(np.float64))  # same values, other dtype
    assert not verify.same_bytes(a, a.reshape(1, 3))
    b = a.copy()
    b.view(np.uint8)[4] ^= 1  # 1.0 -> 1.0000001
    assert not verify.same_bytes(a, b) and np.allclose(a[:2], b[:2])


def test_arm_digest_sees_every_part():
    st, lg, toks = [np.arange(6, dtype=np.float32).reshape(2, 3)], np.ones(4, np.float32), [3, 1]
    d = verify.arm_digest(st, lg, toks)
    assert len(d) == 64 and d == verify.arm_digest([st[0].copy()], lg.copy(), list(toks))
    flipped = st[0].copy()
    flipped.view(np.uint8)[-1] ^= 0x80
    assert verify.arm_digest([flipped], lg, toks) != d
    assert verify.arm_digest(st, lg * 2, toks) != d
    assert verify.arm_digest(st, lg, [3, 2]) != d


def test_state_names_follow_tree_order():
    import jax

    cfg = types.SimpleNamespace(layer_types=["linear_attention", "full_attention"], delta_rule="token")
    assert verify.state_names(cfg) == ["L0.conv", "L0.ssm", "L1.k", "L1.v"]
    state = [{"ssm": np.zeros(1), "conv": np.ones(1)}, {"v": np.full(1, 3.0), "k": np.full(1, 2.0)}]
    assert [float(x[0]) for x in jax.tree_util.tree_leaves(state)] == [1.0, 0.0, 2.0, 3.0]  # conv, ssm, k, v
    cfg.delta_rule = "blocked"
    assert verify.state_names(cfg)[:5] == ["L0.blk_c", "L0.blk_k", "L0.blk_u", "L0.conv", "L0.ssm"]


def test_differing_leaves_and_first_diff():
    a = [np.zeros(2), np.ones(2), np.zeros(3)]
    b = [np.zeros(2), np.array([1.0, 2.0]), np.ones(3)]
    assert digests.differing_leaves(a, b) == [1, 2]
    assert verify.first_diff(a, b, ["x", "y", "z"]) == "y"
    assert verify.first_diff(a, [x.copy() for x in a], ["x", "y", "z"]) is None
    assert digests.differing_leaves(a, a[:2]) == [2]


def test_prompts_file_and_selection(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"name": "ids", "ids": [1, 2, 3]}\n\n{"text": "ab"}\n{"ids": [4]}\n')
    tok = types.SimpleNamespace(encode=lambda t: [ord(c) for c in t])
    got = verify.load_prompts(str(p), tok)
    assert got == [{"name": "ids", "ids": [1, 2, 3]}, {"name": "p02", "ids": [97, 98]}, {"name": "p03", "ids": [4]}]
    assert [x["name"] for x in verify.select(got, max_len=2)] == ["p02", "p03"]
    assert [x["name"] for x in verify.select(got, max_len=2, limit=1)] == ["p02"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: a prompt needs 'text' or 'ids'"):
        verify.load_prompts(str(tmp_path / "bad.jsonl"), tok)


def test_write_json_replaces_whole_files(tmp_path):
    out = tmp_path / "deep" / "r.json"
    verify.write_json(str(out), {"a": 1})
    verify.write_json(str(out), {"b": [1, 2]})
    assert json.loads(out.read_text()) == {"b": [1, 2]}
    assert sorted(x.name for x in out.parent.iterdir()) == ["r.json"]  # no temporary left behind
    verify.write_json(None, {"c": 3})  # no path: nothing written, no error


def test_provenance_names_the_commit(monkeypatch):
    monkeypatch.setenv("BARO_COMMIT", "abc123")
    monkeypatch.setenv("BARO_SOMETHING", "1")
    p = verify.provenance()
    assert p["commit"] == "abc123" and p["env"]["BARO_SOMETHING"] == "1" and "BARO_COMMIT" not in p["env"]
    assert {"device", "host", "date", "jax"} <= set(p)
    monkeypatch.delenv("BARO_COMMIT")
    c = records.git_commit()
    assert len(c.split("+")[0]) == 40 or c.startswith("unknown")
