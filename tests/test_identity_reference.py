"""benchmarks/identity.py --reference-json: replay digests of one run checked against another's
(how tier mode under a small device limit is compared with resident mode on the GPU)."""
import json

from benchmarks import identity

BASE = ["--model", "tiny", "--chunks", "16", "--max-len", "40", "--new-tokens", "4"]


def test_reference_digests_match_and_a_changed_one_fails(tmp_path):
    a = tmp_path / "resident.json"
    assert identity.main(BASE + ["--json", str(a)]) == 0
    rows = json.loads(a.read_text())["rows"]
    assert rows and all(len(r["replay_digest"]) == 64 for r in rows)
    b = tmp_path / "tier.json"
    assert identity.main(BASE + ["--mode", "tier", "--reference-json", str(a), "--json", str(b)]) == 0
    ref = json.loads(b.read_text())["summary"]["reference"]
    assert ref["prompts_compared"] == len({(r["prompt"], r["len"]) for r in rows}) and ref["prompts_differing"] == 0

    bad = json.loads(a.read_text())
    bad["rows"][0]["replay_digest"] = "0" * 64
    c = tmp_path / "bad.json"
    c.write_text(json.dumps(bad))
    assert identity.main(BASE + ["--reference-json", str(c), "--json", str(tmp_path / "x.json")]) == 1
