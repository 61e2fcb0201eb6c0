"""python -m baro_jax.generate --prompts-file: many prompts through generate_batch, a JSON line
each in input order, every one equal in ids and logprob bytes to its run alone; each bad line is
refused before the model loads, naming the file, the line and the problem."""
import json

import numpy as np
import pytest

import baro_jax
from baro_jax import Sampling, generate, loading

LINES = [
    {"prompt": "def add(a, b):\n"},
    {"ids": [5, 6, 7], "max_new_tokens": 3},
    {"prompt": "import os\n", "seed": 11, "temperature": 0.8, "top_p": 0.9},
    {"prompt": "x", "max_new_tokens": 0},
]


def write(tmp_path, lines, raw=None):
    p = tmp_path / "prompts.jsonl"
    p.write_text(raw if raw is not None else "\n".join(json.dumps(x) for x in lines) + "\n\n", encoding="utf-8")
    return str(p)


def test_each_line_equals_its_run_alone(tmp_path, capsys):
    path = write(tmp_path, LINES)
    rc = generate.main(["--prompts-file", path, "--max-new-tokens", "5", "--max-batch", "2", "--seed", "4",
                        "--prefill-budget", "512", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    eng = baro_jax.load("tiny", progress=False)
    for line, row in zip(LINES, rows):
        prompt = line.get("prompt", line.get("ids"))
        sp = Sampling(line.get("temperature", 0.0), 0, line.get("top_p", 1.0), line.get("seed", 4))
        alone = eng.generate(prompt, line.get("max_new_tokens", 5), sampling=sp, logprobs=0)
        assert row["generated_ids"] == alone.generated_ids, line
        assert np.asarray(row["logprobs"], np.float32).tobytes() == np.asarray(alone.logprobs, np.float32).tobytes()
        assert row["finish_reason"] == alone.finish_reason and row["text"] == alone.text


def test_n_samples_per_line_each_equal_their_run_alone_at_seed_plus_j(tmp_path, capsys):
    """--n (and a line's "n"): a prompt's samples side by side, "index" the line's prompt and
    "sample" j, drawn at the line's seed + j: each equals its run alone with that seed."""
    lines = [{"prompt": "def add(a, b):\n", "temperature": 0.9, "seed": 3},
             {"ids": [5, 6, 7], "max_new_tokens": 3, "n": 1},
             {"prompt": "import os\n", "temperature": 1.1, "top_k": 9, "n": 3}]
    rc = generate.main(["--prompts-file", write(tmp_path, lines), "--max-new-tokens", "4", "--n", "2", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    eng = baro_jax.load("tiny", progress=False)
    for r in rows:
        line = lines[r["index"]]
        sp = Sampling(line.get("temperature", 0.0), line.get("top_k", 0), 1.0, line.get("seed", 0) + r["sample"])
        alone = eng.generate(line.get("prompt", line.get("ids")), line.get("max_new_tokens", 4), sampling=sp,
                             logprobs=0)
        assert r["generated_ids"] == alone.generated_ids, r
        assert np.asarray(r["logprobs"], np.float32).tobytes() == np.asarray(alone.logprobs, np.float32).tobytes()


BAD = [
    ("{\"prompt\": \"a\", \"n\": 0}\n", "line 1: \"n\" must be an integer >= 1, got 0"),
    ("{\"prompt\": \"a\", \"n\": 2.0}\n", "line 1: \"n\" must be an integer >= 1, got 2.0"),
    ("{\"prompt\": \"a\", \"n\": 2, \"seed\": 9223372036854775807, \"temperature\": 1}\n",
     "line 1: n: sample j of a prompt draws with seed + j"),
    ("{\"prompt\": \"a\"}\nnot json\n", "line 2: not JSON"),
    ("[1, 2]\n", "line 1: expected a JSON object, got list"),
    ("{\"prompt\": \"a\", \"ids\": [1]}\n", "line 1: give exactly one of \"prompt\" (text) and \"ids\""),
    ("{\"max_new_tokens\": 3}\n", "line 1: give exactly one of"),
    ("{\"prompt\": \"a\", \"temprature\": 1}\n", "line 1: unknown field(s) temprature"),
    ("{\"prompt\": \"\"}\n", "line 1: \"prompt\" must be non-empty text"),
    ("{\"ids\": [1, \"2\"]}\n", "line 1: \"ids\" must be a non-empty list of integers"),
    ("{\"ids\": [1, 999]}\n", "line 1: token id(s) [999] outside the vocabulary"),
    ("{\"prompt\": \"a\", \"max_new_tokens\": -2}\n", "\"max_new_tokens\" must be an integer >= 0, got -2"),
    ("{\"prompt\": \"a\", \"top_k\": 3}\n", "line 1: top_k (--top-k) and top_p (--top-p) filter sampling"),
    ("{\"prompt\": \"a\", \"seed\": 1.5}\n", "line 1: \"seed\" must be an integer, got 1.5"),
    ("{\"prompt\": \"a\", \"temperature\": 1, \"top_k\": 0.5}\n", "line 1: \"top_k\" must be an integer, got 0.5"),
    ("{\"prompt\": \"a\", \"top_p\": \"0.9\"}\n", "line 1: \"top_p\" must be a number, got '0.9'"),
    ("\n\n", "holds no prompt"),
]


@pytest.mark.parametrize("raw,msg", BAD)
def test_bad_lines_are_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, raw, msg):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded for a bad request")

    monkeypatch.setattr(loading, "load", no_load)
    rc = generate.main(["--prompts-file", write(tmp_path, None, raw), "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --prompts-file") and msg in lines[0], err


@pytest.mark.parametrize("args,msg", [
    (("--prompt", "a", "--max-batch", "2"), "--max-batch is for --prompts-file"),
    (("--prompt", "a", "--prefill-budget", "512"), "--prefill-budget is for --prompts-file"),
    (("--prompt", "a", "--n", "2"), "--n is for --prompts-file"),
    (("--prompts-file", "P", "--n", "0"), "--n must be >= 1, got 0"),
    (("--prompts-file", "/nonexistent.jsonl"), "cannot read it (No such file or directory)"),
    (("--prompts-file", "P", "--prompt", "a"), "not allowed with argument"),
])
def test_bad_flags(tmp_path, capsys, monkeypatch, args, msg):
    monkeypatch.setattr(loading, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    args = [write(tmp_path, LINES) if a == "P" else a for a in args]
    rc = generate.main([*args, "--json"])
    _, err = capsys.readouterr()
    assert rc == 2 and msg in err, err
