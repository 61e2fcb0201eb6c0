"""benchmarks/identity_longctx.py on the trained `tiny`: it compares batched arms against replay
in bytes (and passes), and it records a replay that cannot meet its deadline as skipped instead
of running it. The long lengths themselves run on the H200 (run_gpu.sh longctx)."""
import json

import numpy as np
import pytest

from baro_jax.verify import digests, longctx
from benchmarks import identity_longctx


def test_longctx_script_passes_and_skips_past_deadline(tmp_path):
    out = tmp_path / "lc.json"
    rc = identity_longctx.main(["--model", "tiny", "--lengths", "200", "--chunks", "default,48",
                                "--new-tokens", "6", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["summary"]["pass"] and res["summary"]["arms_compared"] == 2
    arms = res["rows"][0]["arms"]
    assert [a["chunk"] for a in arms][1] == 48 and all(a["identical"] for a in arms)
    assert all(a["state_leaves_differing"] == 0 and a["logits_equal"] and a["tokens_equal"] for a in arms)

    out2 = tmp_path / "skip.json"
    rc2 = identity_longctx.main(["--model", "tiny", "--lengths", "200", "--chunks", "48",
                                 "--new-tokens", "2", "--deadline-s", "0", "--json", str(out2)])
    res2 = json.loads(out2.read_text())
    assert rc2 == 1 and not res2["summary"]["pass"]  # nothing compared is not a pass
    assert res2["rows"][0]["replay"]["skipped"] and "needs" in res2["rows"][0]["replay"]["reason"]


def test_longctx_replay_in_two_calls_matches(tmp_path):
    """--replay-stop saves the replay's first part, --replay-resume finishes it and compares:
    the same verdict and bytes as one call; a resume for another length is refused."""
    part = tmp_path / "part"
    first = tmp_path / "first.json"
    rc = identity_longctx.main(["--model", "tiny", "--lengths", "150", "--chunks", "default,48", "--new-tokens", "4",
                                "--replay-stop", "61", "--replay-save", str(part), "--json", str(first)])
    res = json.loads(first.read_text())
    assert rc == 0 and res["summary"]["pass"] is None and res["summary"]["replay_part"]["replayed"] == 61
    assert (part / "replay_150.npz").is_file()
    out = tmp_path / "second.json"
    rc = identity_longctx.main(["--model", "tiny", "--lengths", "150", "--chunks", "default,48", "--new-tokens", "4",
                                "--replay-resume", str(part), "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["summary"]["pass"] and res["summary"]["arms_compared"] == 2
    row = res["rows"][0]
    assert row["replay_parts"]["first"]["tokens"] == 61 and row["replay_parts"]["second"]["tokens"] == 89
    assert all(a["identical"] and a["state_leaves_differing"] == 0 for a in row["arms"])
    with pytest.raises(SystemExit):  # no saved part for this length
        identity_longctx.main(["--model", "tiny", "--lengths", "151", "--replay-resume", str(part)])


def test_saved_replay_round_trips_bytes_and_refuses_another_run(tmp_path):
    """save_replay keeps every leaf's bytes (bfloat16 included); load_replay refuses a file
    whose meta or leaf shapes are not this run's."""
    import jax.numpy as jnp

    state = {"a": {"k": jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.bfloat16)},
             "b": {"ssm": jnp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))}}
    path = str(tmp_path / "s.npz")
    meta = {"model": "m", "seed": 1, "prompt_tokens": 9, "state_length": 16}
    longctx.save_replay(path, state, {**meta, "replayed": 5})
    like = {"a": {"k": jnp.zeros((4, 3), jnp.bfloat16)}, "b": {"ssm": jnp.zeros((2, 3), jnp.float32)}}
    got, saved = longctx.load_replay(path, like, meta)
    assert saved["replayed"] == 5 and longctx.saved_meta(path)["seed"] == 1
    assert digests.differing_leaves(digests.host_leaves(got), digests.host_leaves(state)) == []
    with pytest.raises(ValueError, match="seed=1.*this run has 2"):
        longctx.load_replay(path, like, {**meta, "seed": 2})
    with pytest.raises(ValueError, match="leaf 0 is bfloat16"):
        longctx.load_replay(path, {"a": {"k": jnp.zeros((4, 4), jnp.bfloat16)}, "b": like["b"]}, meta)


def test_compare_arm_counts_leaves_and_one_bit():
    ref = {"state": [np.zeros(4, np.float32), np.ones(2, np.float32)], "logits": np.ones(3, np.float32),
           "tokens": [1, 2]}
    assert longctx.compare_arm({k: v for k, v in ref.items()}, ref)["identical"]
    flipped = ref["state"][1].copy()
    flipped.view(np.uint8)[0] ^= 1
    arm = longctx.compare_arm({**ref, "state": [ref["state"][0], flipped]}, ref)
    assert not arm["identical"] and arm["state_leaves_differing"] == 1 and arm["first_differing_leaf"] == 1
    assert arm["logits_equal"] and arm["tokens_equal"] and arm["state_leaves"] == 2
    assert not longctx.compare_arm({**ref, "tokens": [1, 3]}, ref)["identical"]
