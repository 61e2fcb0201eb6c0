"""The CLI with closed, read-only or failing standard streams (issue 28): the log goes to stderr
or nowhere (never to stdout), --json stays exactly one JSON object, and a result that cannot be
written is exit 74 with a line on stderr. Real processes: the shell makes the descriptors.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ("--backend", "xla", "--max-new-tokens", "2", "--chunk", "5")


def cli(redirect: str, *args, timeout=600):
    """python -m baro_jax *args with the shell redirection `redirect` -> (rc, stdout, stderr)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", sys.executable, "-m", "baro_jax", *args],
                       capture_output=True, timeout=timeout, env=env, cwd=ROOT)
    return r.returncode, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")


@pytest.mark.parametrize("redirect", ["2>&-", "2</dev/null"])
def test_json_is_one_object_when_stderr_is_closed_or_read_only(redirect):
    rc, out, err = cli(redirect, *RUN, "--prompt-ids", "1,2,3", "--json")
    assert rc == 0, (rc, out)
    assert out.endswith("\n") and out.count("\n") == 1, out
    o = json.loads(out)
    assert o["prompt_ids"] == [1, 2, 3] and len(o["generated_ids"]) == 2 and o["delta_rule"] == "token"


@pytest.mark.parametrize("redirect", ["2>&-", "2>/dev/full"])
def test_text_mode_log_goes_nowhere_when_stderr_is_closed_or_full(redirect):
    """The header, the weights' progress and the result line are stderr's; stdout holds the
    prompt and the continuation only."""
    rc, out, err = cli(redirect, *RUN, "--prompt", "def f(x):\n")
    assert rc == 0, (rc, out)
    assert out.startswith("def f(x):\n") and "[baro_jax]" not in out and "tok/s" not in out, out
    assert len(out) > len("def f(x):\n")


@pytest.mark.parametrize("redirect", [">&-", "1</dev/null"])
@pytest.mark.parametrize("mode", [("--json",), ()])
def test_stdout_closed_or_read_only_is_an_error_before_any_work(redirect, mode):
    rc, out, err = cli(redirect, *RUN, "--prompt", "x", *mode)
    assert rc == 74, (rc, err)
    lines = err.splitlines()
    assert lines == ["error: standard output is closed or not writable (>&-): there is nowhere to write the result"], err


def test_stdout_full_is_an_error():
    """`> /dev/full`: the writes fail (ENOSPC) once the result is there; one line, exit 74, and no
    second complaint from the interpreter's exit-time flush."""
    rc, out, err = cli(">/dev/full", *RUN, "--prompt-ids", "1,2,3", "--json")
    assert rc == 74, (rc, err)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert errors == ["error: cannot write the result to standard output (No space left on device)"], err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_help_to_a_full_stdout_is_an_error():
    rc, out, err = cli(">/dev/full", "--help")
    assert rc == 74 and err.strip() == "error: cannot write the result to standard output (No space left on device)"
