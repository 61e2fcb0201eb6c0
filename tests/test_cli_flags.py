"""The CLI's flags (issue 27): every flag's help shows its default (the settings flags' from
settings.SPECS), every flag is checked before the model loads, and the ways to start it
(python -m baro_jax, python -m baro_jax.generate, the baro-jax console script) all work.
"""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from baro_jax import generate, loading
from baro_jax.settings import SPEC_BY_FIELD, _default_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XLA = ("--backend", "xla")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def flag_actions():
    return [a for a in generate._parser()._actions if a.option_strings and a.dest != "help"]


def test_every_flag_shows_its_default():
    missing = [a.option_strings[0] for a in flag_actions() if "(default: " not in (a.help or "")]
    assert not missing, f"flags whose help shows no default: {missing}"
    helps = {a.option_strings[0]: a.help % {"default": a.default} for a in flag_actions()}
    assert "(default: 64)" in helps["--max-new-tokens"]
    assert "(default: 0.0)" in helps["--temperature"]
    assert "(default: 0)" in helps["--top-k"] and "(default: 1.0)" in helps["--top-p"]
    assert "(default: 0)" in helps["--seed"]


def test_settings_flags_show_the_settings_doc_default_and_variable():
    """A settings flag's help is settings.SPECS' line: the same doc, the same default, its variable."""
    seen = set()
    for a in flag_actions():
        spec = next((s for s in SPEC_BY_FIELD.values() if s.flag == a.option_strings[0]), None)
        if spec is None:
            continue
        seen.add(spec.field)
        text = a.help.replace("%%", "%")
        assert text.startswith(spec.doc), (spec.field, text)
        assert f"(default: {_default_text(spec)}" in text, (spec.field, text)
        if spec.env:
            assert f"env {spec.env})" in text, (spec.field, text)
    # every setting that has a flag is a flag of the CLI (--cache-slots included)
    assert seen == {s.field for s in SPEC_BY_FIELD.values() if s.flag}, seen


def test_help_text(capsys):
    rc = generate.main(["--help"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""
    flat = " ".join(out.split())
    assert "--cache-slots N" in flat and "(default: auto; env BARO_CACHE_SLOTS)" in flat
    assert "--delta-rule {token,blocked}" in flat and "only so far" not in flat
    assert "(default: 95% of the device)" in flat and "(default: bfloat16)" in flat
    assert "Exit status: 0 done; 2 a bad request" in flat


BAD_FLAGS = [
    (("--top-k", "5"), "top_k (--top-k) and top_p (--top-p) filter sampling, but temperature is 0 (greedy)"),
    (("--top-p", "0.9"), "but temperature is 0 (greedy): give a temperature > 0 (--temperature)"),
    (("--temperature", "-1"), "temperature must be >= 0, got -1.0"),
    (("--top-p", "0", "--temperature", "1"), "top_p must be in (0, 1], got 0.0"),
    (("--top-k", "-3", "--temperature", "1"), "top_k must be >= 0, got -3"),
    (("--top-k", "1000", "--temperature", "1"), "top_k (--top-k) 1000 is larger than the vocabulary of 256"),
    (("--seed", "-1"), "seed must be in [0, 2**63 - 1], got -1"),
    (("--max-new-tokens", "-1"), "max_new_tokens (--max-new-tokens) must be >= 0, got -1"),
    (("--chunk", "0"), "chunk (--chunk) must be >= 1, got 0"),
    (("--cache-slots", "8"), "cache_slots (--cache-slots) sizes tier mode's decode expert cache"),
    (("--cache-slots", "-1", "--mode", "tier"), "cache_slots (--cache-slots) must be >= 0, got -1"),
    (("--variant", "delta-chunk", "--delta-rule", "blocked", "--backend", "auto"),
     "variant delta-chunk replaces the per-token delta rule; it cannot run with delta_rule blocked"),
    (("--devices", "2", "--mode", "tier", "--backend", "auto"), "expert parallel runs in resident mode"),
    (("--max-context", "0"), "max_context (--max-context) must be >= 1, got 0"),
    (("--max-context", "1000000000"), "beyond the model's context of 8192"),
    (("--prompt-ids", "1,x"), "--prompt-ids must be comma-separated integers, got '1,x'"),
    (("--prompt-ids", "1,,2"), "--prompt-ids has an empty entry (two commas in a row, or one at an end): '1,,2'"),
    (("--prompt-ids", "1,2,"), "--prompt-ids has an empty entry"),
    (("--prompt-ids", " "), "--prompt-ids is empty: the prompt needs at least one token"),
    (("--prompt-ids", "300"), "token id(s) [300] outside the vocabulary [0, 256)"),
    (("--prompt-ids", "1,2,3", "--max-context", "4"), "needs 5 positions, more than max_context=4"),
    (("--prompt-ids", "1,2", "--chat"), "--chat wraps prompt text in the chat template"),
    (("--chat",), "has no chat template"),
    (("--prompt-file", "/nonexistent/prompt.txt"), "cannot read it (No such file or directory)"),
    (("--prompt", ""), "--prompt is empty: the prompt needs at least one token"),
    (("--prompt-file", "/dev/null"), "--prompt-file '/dev/null' is empty"),
    (("--top-k", "x"), "argument --top-k: invalid int value: 'x'"),
    (("--temp", "1"), "unrecognized arguments: --temp 1"),  # no abbreviations: a prefix is not a flag
    (("--prompt", "a", "--prompt-ids", "1"), "argument --prompt-ids: not allowed with argument --prompt"),
    (("--backend", "fast"), "argument --backend: invalid choice: 'fast'"),
]


@pytest.mark.parametrize("args,msg", BAD_FLAGS)
def test_bad_flags_are_refused_before_the_model_loads(capsys, monkeypatch, args, msg):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded for a bad request")

    monkeypatch.setattr(loading, "load", no_load)
    backend = () if "--backend" in args else XLA
    t0 = time.perf_counter()
    rc = generate.main([*args, *backend, "--max-new-tokens", "2", "--json"] if "--max-new-tokens" not in args
                       else [*args, *backend, "--json"])
    took = time.perf_counter() - t0
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], err
    assert took < 1.0, f"{took:.2f}s to refuse {args}"  # the imports are warm; no model work


def test_bad_flag_fails_fast_in_a_real_process():
    """Against the 80B preset (whose weights would take minutes to draw): refused by its flags,
    with no header, no loading progress."""
    r = subprocess.run([sys.executable, "-m", "baro_jax", "--model", "qwen3-next-80b-a3b", "--top-k", "5"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith("error: top_k (--top-k) and top_p (--top-p) filter sampling"), r.stderr
    assert "running on" not in r.stderr and "[baro_jax]" not in r.stderr


def test_python_m_baro_jax_help():
    r = subprocess.run([sys.executable, "-m", "baro_jax", "--help"], capture_output=True, text=True, timeout=300,
                       env=_env(), cwd=ROOT)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("usage: python -m baro_jax [-h]") and "--max-new-tokens N" in r.stdout


def test_console_script():
    """pyproject declares baro-jax = baro_jax.generate:main; where it is installed, it runs."""
    import importlib
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    target = scripts["baro-jax"]
    module, _, attr = target.partition(":")
    assert getattr(importlib.import_module(module), attr) is generate.main
    exe = shutil.which("baro-jax")
    if exe is None:  # an editable install made before the script was declared has none
        return
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("usage: baro-jax [-h]"), r.stderr
    r = subprocess.run([exe, "--top-k", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "temperature is 0" in r.stderr


def test_main_without_argv_reads_the_command_line(capsys, monkeypatch):
    """What the console script calls: main() with no arguments takes sys.argv[1:]."""
    monkeypatch.setattr(sys, "argv", ["baro-jax", "--top-p", "2", "--temperature", "1"])
    rc = generate.main()
    assert rc == 2 and "top_p must be in (0, 1], got 2.0" in capsys.readouterr().err


def test_result_line_and_json_say_what_ran(capsys):
    """--delta-rule blocked: the header, the result line and the JSON name the rule that ran."""
    rc = generate.main(["--prompt", "def f(x):\n", *XLA, "--delta-rule", "blocked", "--max-new-tokens", "2",
                        "--chunk", "5"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "[baro_jax] running on cpu | backend xla | resident | delta rule blocked | bfloat16" in err
    result = [ln for ln in err.splitlines() if ln.startswith("[tiny |")]
    assert len(result) == 1 and re.match(r"\[tiny \| xla \| resident \| delta rule blocked \| prefill batch: ",
                                         result[0]), err
    rc = generate.main(["--prompt-ids", "1,2", *XLA, "--max-new-tokens", "1", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and '"delta_rule": "token"' in out and '"variant": null' in out
