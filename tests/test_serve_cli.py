"""python -m baro_jax.serve as a process: it names its address, a SIGTERM or SIGINT while a
response streams lets that response finish and ends the process with status 0; bad flags are one
line and status 2."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from baro_jax.serve.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(*extra):
    proc = subprocess.Popen([sys.executable, "-m", "baro_jax.serve", "--model", "tiny", "--port", "0", "--max-batch",
                             "2", "--max-context", "1024", "--shutdown-timeout", "60", *extra],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    lines = []
    end = time.monotonic() + 120
    while time.monotonic() < end:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving 'tiny' on (http://\S+)", line)
        if m:
            return proc, m.group(1), lines
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(lines))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_lets_the_running_stream_finish_and_exits_0(sig):
    proc, url, lines = _start()
    try:
        got, first = [], threading.Event()

        def client():
            body = {"prompt": "def f(x):\n", "max_tokens": 60, "temperature": 0.5, "seed": 2, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append(line[6:])
                        first.set()

        t = threading.Thread(target=client)
        t.start()
        assert first.wait(120), "no token came"
        proc.send_signal(sig)
        t.join(120)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + rest
    assert f"server stopped ({signal.Signals(sig).name})" in rest
    assert got[-1] == "[DONE]"
    chunks = [json.loads(g)["choices"][0] for g in got[:-1]]
    assert sum(len(c["token_ids"]) for c in chunks) == 60 and chunks[-1]["finish_reason"] == "length"


def test_warm_up_compiles_the_step_graphs_before_listening():
    """--warm-up: progress per graph, a count and a time, all before the address line; then the
    server answers as usual."""
    proc, url, lines = _start("--warm-up", "--warm-up-threads", "2")
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x = ", "max_tokens": 3}, timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines)
    m = re.search(r"warm-up: (\d+) step graphs compiled in [0-9.]+ s on 2 threads", text)
    assert m and f"warm-up: step graph {m.group(1)}/{m.group(1)}" in text, text
    assert text.index("warm-up: ") < text.index("serving 'tiny'")


@pytest.mark.parametrize("args,msg", [
    (["--max-batch", "0"], "error: --max-batch must be >= 1, got 0"),
    (["--max-queue", "-1"], "error: --max-queue must be >= 0, got -1"),
    (["--prefill-budget", "0"], "error: --prefill-budget must be >= 1, got 0"),
    (["--port", "70000"], "error: --port must be in [0, 65535], got 70000"),
    (["--max-body-mb", "0"], "error: --max-body-mb must be > 0, got 0.0"),
    (["--warm-up", "--warm-up-threads", "0"], "error: --warm-up-threads must be >= 1, got 0"),
    (["--warm-up-threads", "4"], "error: --warm-up-threads is for --warm-up: give both, or neither"),
    (["--max-batchh", "3"], "error: unrecognized arguments: --max-batchh 3"),
    (["--model", "/no/such/dir"], "error: "),
])
def test_bad_flags_are_one_line_and_status_2(capsys, args, msg):
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[baro_jax]")]
    assert len(err) == 1 and err[0].startswith(msg), err  # after the loading lines, when it got that far


def test_a_pool_it_cannot_run_is_one_line_and_status_2(capsys, monkeypatch):
    """BARO_DELTA=blocked: the pool holds no pending delta block; the server says so at start."""
    monkeypatch.setenv("BARO_DELTA", "blocked")
    test_bad_flags_are_one_line_and_status_2(capsys, ["--max-context", "1024"],
                                             "error: the server runs the per-token delta rule (delta_rule 'token', "
                                             "BARO_DELTA=token), not 'blocked'")


def test_serve_bench_dry_run_checks_every_response(bench_script, tmp_path):
    """benchmarks/serve_bench.py on tiny: each level's responses equal their references, and the
    JSON says where and from what it ran."""
    out = tmp_path / "serve.json"
    r = bench_script("serve_bench", "--clients", "1,3", "--prompt-len", "8", "--new-tokens", "5", "--chunk", "16",
                     "--prefill-budget", "48", "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    assert d["summary"]["pass"] and [row["clients"] for row in d["rows"]] == [1, 3]
    assert d["summary"]["prefill_budget"] == 48
    for row in d["rows"]:
        assert row["equal_solo"] == row["requests"] == row["clients"] and row["output_tokens"] == 5 * row["requests"]
        assert row["ttft_p50_s"] > 0 and row["health"]["free_slots"] == row["health"]["slots"]
    assert d["summary"]["commit"] and d["summary"]["device"].startswith("cpu")
    assert d["summary"]["warm_up"]["graphs"] > 0 and d["summary"]["warm_up"]["threads"] >= 1
    # every request sampled with a top_k (drawn inside the server pool's decode graphs): still each
    # response equal to its run alone; no warm-up (the rounds compile what they meet)
    r = bench_script("serve_bench", "--clients", "3", "--prompt-len", "8", "--new-tokens", "6", "--chunk", "16",
                     "--sampled-every", "1", "--sample-top-k", "20", "--sample-top-p", "0.9", "--warm-up-threads", "0",
                     "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    assert d["summary"]["pass"] and d["summary"]["sampling"]["top_k"] == 20
    assert d["summary"]["warm_up"] == {"graphs": 0, "seconds": 0.0, "threads": 0}
    assert d["rows"][0]["equal_solo"] == d["rows"][0]["requests"] == 3
