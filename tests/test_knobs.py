"""The kernel knobs: one C++ reader (csrc/common/knobs.h), the same table in custom_calls/knobs.py,
strict parsing on both sides."""
from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls import knobs as K

ROOT = Path(__file__).resolve().parents[1]
KNOBS_H = ROOT / "csrc" / "common" / "knobs.h"
ROW = re.compile(r'\{"(BARO_\w+)", Kind::k(\w+), (nullptr|"([^"]*)"), (\w+), (\w+), (\w+)\}')
KIND = {"OnOff": "onoff", "Choice": "choice", "Int": "int"}


def cpp_table():
    rows = {}
    text = KNOBS_H.read_text()
    consts = dict(re.findall(r"constexpr int (k\w+) = (\d+);", text))
    for name, kind, _, choices, lo, hi, dflt in ROW.findall(text):
        val = lambda t: int(consts.get(t, t))  # noqa: E731
        rows[name] = (KIND[kind], tuple(choices.split("|")) if choices else (), val(lo), val(hi), val(dflt))
    return rows


def csrc_files():
    return [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cc", ".cu", ".cuh", ".cpp")]


def test_every_getenv_in_csrc_is_the_table_reader():
    """No C++ file reads the environment but knobs.h, and knobs.h only through its table."""
    calls = {}
    for p in csrc_files():
        code = re.sub(r"//[^\n]*", "", p.read_text())  # comments may say "getenv"
        n = len(re.findall(r"\bgetenv\s*\(", code))
        if n:
            calls[p.relative_to(ROOT).as_posix()] = n
    assert calls == {"csrc/common/knobs.h": 1}, calls
    assert re.search(r"std::getenv\(k\.name\)", KNOBS_H.read_text())


def test_every_knob_name_in_csrc_is_in_the_table():
    """A BARO_* string in the C++ sources is a knob of the table (catches a name read some other way)."""
    table = set(cpp_table())
    for p in csrc_files():
        names = set(re.findall(r'"(BARO_[A-Z0-9_]+)"', p.read_text()))
        assert names <= table, f"{p}: {sorted(names - table)} not in knobs.h"


def test_cpp_table_equals_the_python_table():
    cpp = cpp_table()
    assert len(cpp) == KNOBS_H.read_text().count('{"BARO_'), "a knobs.h row the test cannot read"
    assert sorted(cpp) == sorted(K.CPP_KNOBS)
    for name, (kind, choices, lo, hi, dflt) in cpp.items():
        k = K.BY_NAME[name]
        assert k.kind == kind, name
        if kind == "onoff":
            assert k.default == bool(dflt), name
        elif kind == "choice":
            assert k.choices == choices and k.default == choices[0] and dflt == 0, name
        else:
            assert (k.lo, k.hi) == (lo, hi), name
            # a default outside the range (BARO_CPU_THREADS' 0) is computed at run time
            assert k.default == (dflt if lo <= dflt <= hi else None), name
    python_only = {k.name for k in K.KNOBS.values() if k.reader == "Python"}
    readers = {"BARO_CMDBUF_OPS": "custom_calls/_lib.py", "BARO_LIB_DIR": "custom_calls/_lib.py",
               "BARO_MOE_SMALL_ROWS": "custom_calls/moe.py", "BARO_TOPK_ROWS": "custom_calls/topk.py",
               "BARO_GDN_PACK16": "custom_calls/matmul.py"}
    assert python_only == set(readers)
    for name, file in readers.items():  # and they are read where the table says
        assert f'knob("{name}")' in (ROOT / file).read_text() or name == "BARO_LIB_DIR", name
        assert file in K.BY_NAME[name].doc, name


def test_knobs_table_lists_every_knob():
    t = K.knobs_table().splitlines()
    assert t[0] == "| knob | values | default | what it does |"
    assert len(t) == 2 + len(K.KNOBS)
    assert list(K.KNOBS) == [k.name for k in K.KNOBS.values()]  # iterating the table gives the names
    for k, row in zip(K.KNOBS.values(), t[2:]):
        assert row.startswith(f"| `{k.name}` | ") and row.count(" | ") == 3, row


@pytest.mark.parametrize("name,text,want", [
    ("BARO_MOE_FOLD", "0", False), ("BARO_MOE_FOLD", "off", False), ("BARO_MOE_FOLD", "NO", False),
    ("BARO_PDL", "True", True), ("BARO_PDL", "yes", True), ("BARO_PDL", "", False),
    ("BARO_MOE_TAIL", "combine", "combine"), ("BARO_GEMM_TILE", "128", "128"), ("BARO_GEMM_TILE", "", "auto"),
    ("BARO_ROW1_BPS", "8", 8), ("BARO_ROW1_NT", "0", 0), ("BARO_CPU_THREADS", "+2", 2),
    ("BARO_CMDBUF_OPS", "off", False), ("BARO_MOE_SMALL_ROWS", "16", 16), ("BARO_MOE_SMALL_ROWS", "", 64),
])
def test_knob_parses_the_allowed_values(name, text, want):
    assert K.knob(name, {name: text}) == want


@pytest.mark.parametrize("name,text,allowed", [
    ("BARO_MOE_FOLD", "abc", r"on or off \(one of 1/true/on/yes or 0/false/off/no\)"),
    ("BARO_PDL", "2", r"on or off"), ("BARO_PDL", " 1", r"on or off"),
    ("BARO_MOE_TAIL", "COMBINE", r"one of 1, 0, combine"), ("BARO_GEMM_TILE", "32", r"one of auto, 16, simple, 64, 128"),
    ("BARO_ROW1_BPS", "9", r"an integer in \[1, 8\]"), ("BARO_ROW1_KCHUNK", "1.5e3", r"an integer in \[128, 4096\]"),
    ("BARO_CPU_THREADS", "0", r"an integer in \[1, 4096\]"), ("BARO_CPU_THREADS", "99999999999999999999", r"an integer in \[1, 4096\]"),
    ("BARO_CMDBUF_OPS", "abc", r"on or off"),
])
def test_knob_refuses_what_it_does_not_allow(name, text, allowed):
    with pytest.raises(K.KnobError, match=rf"^{name} must be {allowed}.*, got {re.escape(repr(text))}$"):
        K.knob(name, {name: text})


def test_wrappers_refuse_a_bad_knob_before_the_call(monkeypatch):
    x, w = jnp.zeros((3, 8), jnp.bfloat16), jnp.zeros((5, 8), jnp.bfloat16)
    monkeypatch.setenv("BARO_GEMM_TILE", "32")
    with pytest.raises(ValueError, match=r"baro_matmul: BARO_GEMM_TILE must be one of auto, 16, simple, 64, 128, "
                                         r"got '32'"):
        cc.matmul(x, w)
    monkeypatch.setenv("BARO_GEMM_TILE", "64")
    cc.matmul(x, w)  # allowed again (read on each call)
    monkeypatch.setenv("BARO_CMDBUF_OPS", "abc")  # read when the wrapper picks the op
    with pytest.raises(ValueError, match=r"BARO_CMDBUF_OPS must be on or off"):
        cc.moe(jnp.zeros((1, 8), jnp.bfloat16), jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((4, 8, 8), jnp.bfloat16),
               jnp.zeros((4, 8, 4), jnp.bfloat16), jnp.zeros((8, 8), jnp.bfloat16), jnp.zeros((8, 4), jnp.bfloat16),
               jnp.zeros((1, 8), jnp.bfloat16), 2)


def test_cpu_handler_refuses_a_bad_knob(monkeypatch):
    """Past the Python checks, the handler itself fails the call with the variable named (and
    reads the knob again on the next call)."""
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(np.ones((3, 64), np.float32).astype(jnp.bfloat16), cpu)
    w = jax.device_put(np.ones((5, 64), np.float32).astype(jnp.bfloat16), cpu)
    call = jax.ffi.ffi_call("baro_matmul", jax.ShapeDtypeStruct((3, 5), jnp.float32))
    for bad in ("abc", "0", "-3", "5000"):
        monkeypatch.setenv("BARO_CPU_THREADS", bad)
        with pytest.raises(Exception, match=rf"BARO_CPU_THREADS must be an integer in \[1, 4096\], got '{bad}'"):
            jax.block_until_ready(call(x, w, bf16_cols=np.int64(0)))
    monkeypatch.setenv("BARO_CPU_THREADS", "2")
    assert np.asarray(call(x, w, bf16_cols=np.int64(0))).tolist() == [[64.0] * 5] * 3
    monkeypatch.delenv("BARO_CPU_THREADS")
    assert os.environ.get("BARO_CPU_THREADS") is None
    assert np.asarray(call(x, w, bf16_cols=np.int64(0))).tolist() == [[64.0] * 5] * 3
