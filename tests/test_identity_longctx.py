"""benchmarks/identity_longctx.py on the trained `tiny`: it compares batched arms against replay
in bytes (and passes), and it records a replay that cannot meet its deadline as skipped instead
of running it. The long lengths themselves run on the H200 (run_gpu.sh longctx)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import identity_longctx  # noqa: E402


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
    import pytest

    with pytest.raises(SystemExit):  # no saved part for this length
        identity_longctx.main(["--model", "tiny", "--lengths", "151", "--replay-resume", str(part)])
