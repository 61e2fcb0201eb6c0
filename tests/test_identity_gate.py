"""The identity gate's CPU form: batched prefill == replay, bytes of states, logits and tokens."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import identity  # noqa: E402


def test_identity_gate_ordered_cpu(tmp_path):
    out = tmp_path / "identity.json"
    rc = identity.main(["--model", "tiny", "--backend", "ordered", "--chunks", "7,16,37,64",
                        "--max-len", "300", "--new-tokens", "64", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0, [r for r in res["rows"] if not (r["state_equal"] and r["logits_equal"] and r["tokens_equal"])]
    s = res["summary"]
    assert s["pass"] and s["cases"] >= 23 * 4
    # the prompt set must cross one and several chunk boundaries for every chunk size
    for c in (7, 16, 37, 64):
        crossed = {r["boundaries_crossed"] for r in res["rows"] if r["chunk"] == c}
        assert 1 in crossed and max(crossed) >= 3


def test_identity_gate_detects_differences(tmp_path):
    """The xla backend is not row-invariant: the gate must say so and exit non-zero."""
    rc = identity.main(["--model", "tiny", "--backend", "xla", "--chunks", "16", "--max-len", "70",
                        "--new-tokens", "4", "--json", str(tmp_path / "x.json")])
    res = json.loads((tmp_path / "x.json").read_text())
    assert rc == 1 and not res["summary"]["pass"]
    assert any(r["first_state_diff"] for r in res["rows"])
