"""Bad input through the CLI (issue 13): one clear line on stderr, a non-zero exit, no traceback.

In-process through generate.main (fast, graphs shared); two subprocesses for what only a real
process shows: non-UTF-8 argv bytes and a pipe closed early.
"""
import io
import json
import os
import subprocess
import sys

import pytest

from baro_jax import generate

XLA = ("--backend", "xla")


def run(capsys, *args):
    rc = generate.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err):
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("args,msg", [
    (("--temperature", "nan"), "temperature must be a finite number, got nan"),
    (("--temperature", "inf"), "temperature must be a finite number, got inf"),
    (("--temperature", "-0.5"), "temperature must be >= 0"),
    (("--top-p", "nan"), "top_p must be a finite number"),
    (("--seed", str(2**70)), "seed must be in [0, 2**63 - 1]"),
    (("--seed", "-1"), "seed must be in [0, 2**63 - 1], got -1"),
    (("--device-budget-gb", "inf"), "device_budget_gb (--device-budget-gb) must be a finite number > 0, got inf"),
    (("--device-budget-gb", "nan"), "device_budget_gb (--device-budget-gb) must be a finite number > 0, got nan"),
    (("--device-budget-gb", "-1"), "device_budget_gb (--device-budget-gb) must be a finite number > 0, got -1.0"),
    (("--chunk", "0"), "chunk (--chunk) must be >= 1, got 0"),
    (("--max-context", "0"), "max_context (--max-context) must be >= 1, got 0"),
    (("--max-context", "1000000000"), "max_context (--max-context) 1000000000 is beyond the model's context of 8192"),
    (("--max-new-tokens", "-2"), "max_new_tokens (--max-new-tokens) must be >= 0"),
    (("--prompt-ids", "-1,2"), "token id(s) [-1] outside the vocabulary [0, 256)"),
    (("--prompt-ids=-1,2",), "token id(s) [-1] outside the vocabulary"),
    (("--prompt-ids", "1.5,2"), "--prompt-ids must be comma-separated integers"),
    (("--top-k", "1000", "--temperature", "1"), "top_k (--top-k) 1000 is larger than the vocabulary of 256"),
])
def test_bad_values_one_line(capsys, args, msg):
    rc, out, err = run(capsys, *args, *XLA, "--max-new-tokens", "2", "--json") if "--max-new-tokens" not in args \
        else run(capsys, *args, *XLA, "--json")
    assert rc == 2
    assert msg in one_error_line(err), err


def test_prompt_file_directory_and_not_utf8(capsys, tmp_path):
    rc, out, err = run(capsys, "--prompt-file", str(tmp_path), *XLA, "--json")
    assert rc == 2 and f"--prompt-file {str(tmp_path)!r}: cannot read it (Is a directory)" in one_error_line(err)
    p = tmp_path / "latin1.txt"
    p.write_bytes(b"caf\xe9\n")
    rc, out, err = run(capsys, "--prompt-file", str(p), *XLA, "--json")
    assert rc == 2 and "is not UTF-8 text" in one_error_line(err)
    rc, out, err = run(capsys, "--prompt-file", str(tmp_path / "nope.txt"), *XLA, "--json")
    assert rc == 2 and "cannot read it (No such file or directory)" in one_error_line(err)


def test_bad_checkpoint_through_the_cli(capsys, tmp_path):
    from bad_input_util import edit_config, tiny_copy

    d = tiny_copy(tmp_path)
    edit_config(d, lambda r: r.update(rms_norm_eps=-1.0))
    rc, out, err = run(capsys, "--model", d, *XLA, "--json")
    line = one_error_line(err)
    assert rc == 2 and os.path.join(d, "config.json") in line and "field 'rms_norm_eps' must be a number in" in line


def test_surrogate_argv_in_process(capsys):
    rc, out, err = run(capsys, "--prompt", "ab\udcffc", *XLA)  # what Python makes of a non-UTF-8 byte
    assert rc == 2 and "command-line argument 2 ('ab\\udcffc') is not valid UTF-8" in one_error_line(err)


def test_ctrl_c_and_broken_pipe_in_process(capsys, monkeypatch):
    from baro_jax.engine import Engine

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupt)
    rc, out, err = run(capsys, *XLA, "--max-new-tokens", "1")
    assert rc == 130 and "interrupted (Ctrl-C)" in one_error_line(err)
    monkeypatch.undo()

    class ClosedPipe(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    rc = generate.main(["--prompt", "x", *XLA, "--max-new-tokens", "2"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert rc == 141 and "broken pipe" in one_error_line(err)


def test_header_names_device_and_backend_and_progress(capsys, monkeypatch):
    monkeypatch.setattr(generate, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(generate, "PROGRESS_EVERY_S", 0.0)
    rc, out, err = run(capsys, "--prompt", "def f(x):\n  ", *XLA, "--max-new-tokens", "2",
                       "--chunk", "5")  # 12 tokens; chunk 5 as test_cli (the compiled graph is shared)
    assert rc == 0, err
    assert "[baro_jax] running on cpu | backend xla | resident | bfloat16" in err
    prog = [ln for ln in err.splitlines() if ln.startswith("[baro_jax] prefill ")]
    assert [ln.split()[2] for ln in prog] == ["5/12", "10/12", "12/12"], err
    assert all("tok/s" in ln for ln in prog)
    # --json: stdout is one JSON object, no header or progress on stderr
    rc, out, err = run(capsys, "--prompt-ids", "1,2,3", *XLA, "--max-new-tokens", "1", "--json")
    assert rc == 0 and json.loads(out)["prompt_ids"] == [1, 2, 3] and "running on" not in err


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def test_non_utf8_argv_bytes_subprocess():
    r = subprocess.run([sys.executable, "-m", "baro_jax.generate", "--prompt", b"caf\xe9"], capture_output=True,
                       timeout=300, env=_env())
    err = r.stderr.decode()
    assert r.returncode == 2 and "is not valid UTF-8" in err and "Traceback" not in err, err


def test_broken_pipe_subprocess():
    """`python -m baro_jax.generate | head -c 1`: the reader goes away; one line, exit 141."""
    p = subprocess.Popen([sys.executable, "-m", "baro_jax.generate", "--backend", "xla", "--max-new-tokens", "64",
                          "--prompt", "x" * 10], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=300)
    assert rc == 141 and "Traceback" not in err and "broken pipe" in err, (rc, err)


@pytest.mark.parametrize("template,msg", [
    ("{% if %}hi{% endif %}", "chat template syntax error at line 1"),
    ("line one\n{{ undefined_function() }}", "the chat template fails to render at line 2"),
    ("{{ raise_exception('only system and user roles') }}", "the chat template refused the conversation"),
])
def test_chat_template_errors_name_the_file(capsys, tmp_path, template, msg):
    """A broken chat template is the checkpoint's problem, told as such (exit 2), not an
    internal error to report."""
    from bad_input_util import tiny_copy

    d = tiny_copy(tmp_path)
    path = os.path.join(d, "chat_template.jinja")
    with open(path, "w") as f:
        f.write(template)
    rc, out, err = run(capsys, "--model", d, "--chat", "--prompt", "hi", *XLA, "--json")
    line = one_error_line(err)
    assert rc == 2 and out == "", err
    assert line.startswith(f"error: {path}: ") and msg in line and "internal error" not in line, line


def test_chat_template_value_error_is_a_bad_request(capsys, monkeypatch):
    """Whatever ValueError the template code raises reaches the 'error:' line with exit 2."""
    from baro_jax import tokenizer

    def bad(tok, text):
        raise ValueError("/ckpt/tokenizer_config.json field 'chat_template': something the template did")

    monkeypatch.setattr(tokenizer, "apply_chat_template", bad)
    rc, out, err = run(capsys, "--chat", "--prompt", "hi", *XLA, "--json")
    assert rc == 2 and one_error_line(err) == ("error: /ckpt/tokenizer_config.json field 'chat_template': "
                                               "something the template did")


@pytest.mark.parametrize("args,env", [
    (("--variant", "delta-chunk", "--delta-rule", "blocked"), {}),
    (("--variant", "delta-chunk"), {"BARO_DELTA": "blocked"}),
    (("--delta-rule", "blocked"), {"BARO_VARIANT": "delta-chunk"}),
])
def test_delta_chunk_with_the_blocked_rule_is_refused(capsys, monkeypatch, args, env):
    """The delta-chunk variant replaces the per-token rule: with the blocked rule asked for too,
    one clear line (it used to run the blocked rule and report delta-chunk)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, out, err = run(capsys, *args, "--json")
    assert rc == 2 and out == ""
    assert "variant delta-chunk replaces the per-token delta rule; it cannot run with delta_rule blocked" \
        in one_error_line(err), err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("args,msg", [
    (("--max-new-tokens", "many"), "error: argument --max-new-tokens: invalid int value: 'many'"),
    (("--no-such-flag",), "error: unrecognized arguments: --no-such-flag"),
    (("--mode",), "error: argument --mode: expected one argument"),
])
def test_usage_errors_are_one_line(capsys, args, msg):
    rc, out, err = run(capsys, *args)
    assert rc == 2 and out == ""
    assert err.splitlines() == [f"{msg} (baro-jax --help lists the flags)"], err
