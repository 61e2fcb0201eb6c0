"""CLI smoke tests: the tiny model end to end, both prefill arms, clear errors."""
import json
import subprocess
import sys

import pytest


def run_cli(*args, env=None):
    import os

    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "baro_jax.generate", *args], capture_output=True, text=True,
                          env=e, timeout=600)


@pytest.mark.parametrize("prefill,backend", [("replay", "xla"), ("batch", "xla")])
def test_json_run(prefill, backend):
    r = run_cli("--model", "tiny", "--prompt", "def add(a, b):\n", "--max-new-tokens", "8",
                "--prefill", prefill, "--chunk", "5", "--backend", backend, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_ids"] == list(b"def add(a, b):\n")
    assert len(out["generated_ids"]) == 8
    assert out["backend"] == backend and out["prefill_mode"] == prefill
    for k in ("text", "prefill_seconds", "prefill_tokens_per_s", "decode_tokens_per_s", "model"):
        assert k in out


def test_prompt_ids_and_env_arm():
    r = run_cli("--prompt-ids", "1,2,3,4", "--max-new-tokens", "3", "--backend", "xla", "--json",
                env={"BARO_PREFILL": "1", "BARO_PREFILL_C": "3"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_ids"] == [1, 2, 3, 4] and out["prefill_mode"] == "batch" and out["chunk"] == 3


def test_seeded_sampling_repeats():
    args = ("--prompt", "x = ", "--max-new-tokens", "6", "--backend", "xla", "--temperature", "1.0",
            "--top-k", "50", "--top-p", "0.9", "--seed", "7", "--json")
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["generated_ids"] == json.loads(b.stdout)["generated_ids"]


def test_streams_text_and_says_demo():
    r = run_cli("--prompt", "abc", "--max-new-tokens", "4", "--backend", "xla")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("abc")
    assert "random-weight demo" in r.stderr or "demonstration" in r.stderr


@pytest.mark.parametrize("args,msg", [
    (("--model", "no-such-model"), "neither a checkpoint directory nor a preset"),
    (("--prompt-ids", "1,x"), "comma-separated integers"),
    (("--prompt-ids", "999999"), "outside the vocabulary"),
    (("--prompt", "a" * 50, "--max-context", "40"), "more than the context"),
    (("--dtype", "float32", "--backend", "ordered"), "bfloat16 only"),
])
def test_clear_errors(args, msg):
    r = run_cli(*args, "--max-new-tokens", "2", "--json")
    assert r.returncode == 2
    assert msg in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
