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
