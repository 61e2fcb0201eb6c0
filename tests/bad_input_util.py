"""Helpers for the bad-input tests: copies of the embedded tiny checkpoint, corrupted on purpose."""
import json
import os
import shutil
import struct

import baro_jax

TINY = os.path.join(os.path.dirname(baro_jax.__file__), "checkpoints", "tiny")
ST = "model.safetensors"


def tiny_copy(tmp_path, name="ckpt") -> str:
    d = os.path.join(str(tmp_path), name)
    shutil.copytree(TINY, d)
    return d


def read_st(path):
    """(header dict, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        b = f.read()
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8:8 + n]), b[8 + n:]


def write_st(path, header, data: bytes):
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + data)


def edit_config(d, fn):
    p = os.path.join(d, "config.json")
    with open(p) as f:
        raw = json.load(f)
    fn(raw)
    with open(p, "w") as f:
        json.dump(raw, f)
