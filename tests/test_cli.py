"""CLI smoke tests: the tiny model end to end, both prefill arms, clear errors.

Most run `generate.main` in-process (compiled graphs are shared between runs);
one runs `python -m baro_jax.generate` as a user would.
"""
import json
import subprocess
import sys

import pytest

from baro_jax import generate


def run_main(capsys, monkeypatch, *args, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    rc = generate.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("prefill", ["replay", "batch"])
def test_json_run(capsys, monkeypatch, prefill):
    rc, out, err = run_main(capsys, monkeypatch, "--model", "tiny", "--prompt", "def add(a, b):\n",
                            "--max-new-tokens", "8", "--prefill", prefill, "--chunk", "5", "--backend", "xla", "--json")
    assert rc == 0, err
    o = json.loads(out)
    assert o["prompt_ids"] == list(b"def add(a, b):\n")
    assert len(o["generated_ids"]) == 8
    assert o["backend"] == "xla" and o["prefill_mode"] == prefill
    for k in ("text", "prefill_seconds", "prefill_tokens_per_s", "decode_tokens_per_s", "model"):
        assert k in o


def test_prompt_ids_and_env_arm(capsys, monkeypatch):
    rc, out, err = run_main(capsys, monkeypatch, "--prompt-ids", "1,2,3,4", "--max-new-tokens", "3", "--backend",
                            "xla", "--chunk", "5", "--json", env={"BARO_PREFILL": "1"})
    assert rc == 0, err
    o = json.loads(out)
    assert o["prompt_ids"] == [1, 2, 3, 4] and o["prefill_mode"] == "batch" and o["chunk"] == 5


def test_env_chunk(capsys, monkeypatch):
    """BARO_PREFILL_C reaches the run through the settings; a bad value is refused naming it."""
    rc, out, err = run_main(capsys, monkeypatch, "--prompt-ids", "1,2,3,4", "--max-new-tokens", "1", "--backend",
                            "xla", "--json", env={"BARO_PREFILL_C": "3"})
    assert rc == 0, err
    assert json.loads(out)["chunk"] == 3
    rc, out, err = run_main(capsys, monkeypatch, "--backend", "xla", "--json", env={"BARO_PREFILL_C": "zero"})
    assert rc == 2 and out == ""
    assert "error: BARO_PREFILL_C must be an integer, got 'zero'" in err, err


def test_small_chunk_hint(capsys, monkeypatch):
    """When the engine's own chunk comes out below the prompt's default (a tight device budget), the
    text run says so and how to change it; not when the chunk is the default or given with --chunk."""
    import baro_jax.runner as runner_mod
    from baro_jax.shapes import default_chunk

    prompt = ("--prompt-ids", ",".join(str(i % 200 + 1) for i in range(40)), "--max-new-tokens", "1", "--backend", "xla")
    rc, out, err = run_main(capsys, monkeypatch, *prompt)
    assert rc == 0, err
    assert "prefill ran in chunks of" not in err, err
    monkeypatch.setattr(runner_mod.Runner, "pick_chunk", lambda self, n_prompt, n_new=0: 16)
    rc, out, err = run_main(capsys, monkeypatch, *prompt)
    assert rc == 0, err
    assert f"prefill ran in chunks of 16 rows, not {default_chunk(40)}" in err, err
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in err and "--chunk" in err
    rc, out, err = run_main(capsys, monkeypatch, *prompt, "--chunk", "16")
    assert rc == 0, err
    assert "prefill ran in chunks of" not in err, err
    rc, out, err = run_main(capsys, monkeypatch, *prompt, "--json")
    assert rc == 0, err
    assert json.loads(out)["chunk"] == 16 and "prefill ran in chunks of" not in err


def test_seeded_sampling_repeats(capsys, monkeypatch):
    args = ("--prompt", "x = ", "--max-new-tokens", "6", "--backend", "xla", "--temperature", "1.0",
            "--top-k", "50", "--top-p", "0.9", "--seed", "7", "--json")
    a = run_main(capsys, monkeypatch, *args)
    b = run_main(capsys, monkeypatch, *args)
    assert a[0] == 0, a[2]
    assert json.loads(a[1])["generated_ids"] == json.loads(b[1])["generated_ids"]


@pytest.mark.parametrize("args,msg", [
    (("--model", "no-such-model"), "neither a checkpoint directory nor a preset"),
    (("--prompt-ids", "1,x"), "comma-separated integers"),
    (("--prompt-ids", "999999"), "outside the vocabulary"),
    (("--prompt", "a" * 50, "--max-context", "40"), "needs 52 positions, more than max_context=40"),
    (("--dtype", "float32", "--backend", "ordered"), "bfloat16 only"),
    (("--temperature", "-1"), "temperature must be >= 0"),
    (("--chat",), "no chat template"),
])
def test_clear_errors(capsys, monkeypatch, args, msg):
    rc, out, err = run_main(capsys, monkeypatch, *args, "--max-new-tokens", "2", "--backend", "xla", "--json") \
        if "--backend" not in args else run_main(capsys, monkeypatch, *args, "--max-new-tokens", "2", "--json")
    assert rc == 2
    assert msg in err, err


def test_python_m_streams_text():
    r = subprocess.run([sys.executable, "-m", "baro_jax.generate", "--prompt", "abc", "--max-new-tokens", "4"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("abc")
    assert "tok/s" in r.stderr


def test_model_too_large_for_device(capsys, monkeypatch):
    from baro_jax import budget

    monkeypatch.setattr(budget, "device_memory_bytes", lambda: 8 << 30)
    rc, out, err = run_main(capsys, monkeypatch, "--model", "qwen3.5-35b-a3b", "--backend", "xla", "--json")
    assert rc == 2 and "the weights need 64." in err and "8.0 GiB" in err, err
