"""Load transformers / official safetensors checkpoints into baro_jax's params tree.

The params tree (A = the requested dtype, bf16 by default, f32 for parity tests)::

    params = {
      "embed": [V, D] A,  "final_norm": [D] f32,  "lm_head": [V, D] A (the embed array if tied),
      "layers": (layer_0, layer_1, ...),   # a tuple of dicts
    }
    layer = {
      "in_norm": [D] f32, "post_norm": [D] f32,
      "moe": {"router": [E, D], "gate_up": [E, 2I, D] (gate rows first), "down": [E, D, I],
              "shared_gate_up": [2Is, D] (gate rows first), "shared_down": [D, Is], "shared_gate": [1, D]},
      # full attention layers:
      "attn": {"qkv": [(2H + 2Hkv) * hd, D] (q_proj rows, then k_proj, then v_proj),
               "o": [D, H * hd], "q_norm": [hd] f32, "k_norm": [hd] f32},
      # Gated DeltaNet layers:
      "gdn": {"in_proj": [conv_dim + nv*dv + 2*nv, D] (flat q | k | v, then z, then b, then a),
              "conv": [conv_dim, 4], "A_log": [nv] f32, "dt_bias": [nv] f32, "norm": [dv] f32,
              "out": [D, nv * dv]},
    }

Checkpoint naming. Everything under a prefix, either ``model.language_model.``
(official Qwen3.5 and transformers' save of ``Qwen3_5MoeForConditionalGeneration``)
or ``model.`` (Qwen3-Next, and transformers' save of ``Qwen3_5MoeForCausalLM`` /
``qwen3_5_moe_text``), plus a top-level ``lm_head.weight``. ``mtp.*`` and
``model.visual.*`` are ignored, so is ``lm_head.weight`` when the embeddings are
tied. Experts are either fused (``mlp.experts.gate_up_proj`` [E, 2I, D],
``mlp.experts.down_proj`` [E, D, I]: the official Qwen3.5 files) or per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``: what transformers 5.x
save_pretrained writes for both architectures, and the official Qwen3-Next
files). The Gated DeltaNet input projection is either flat (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``: Qwen3.5) or grouped per key head
(``in_proj_qkvz``, ``in_proj_ba``: Qwen3-Next), regrouped here exactly as
transformers' ``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`` does.

The layout of every layer is detected from the tensor names; then every expected
tensor name, with its shape, is derived from one table (``_LAYER_TABLE``) and the
Config, and all missing / unknown / mis-shaped tensors are reported together
(``WeightsError``) before any tensor data is read.

Loading reads the safetensors files directly (memory-mapped; bf16 via
ml_dtypes), shard by shard, converting each tensor to its final dtype and
putting it on the default device as soon as the whole target array is known, so
the host never holds more than the tensors of one target in flight (for the
per-expert layout: one layer's expert stack).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import FULL, Config
from .settings import Settings

__all__ = ["WeightsError", "load_params", "params_from_state_dict", "checkpoint_files", "param_shapes"]


class WeightsError(ValueError):
    """A checkpoint's tensors do not match what the Config requires."""


# ----------------------------------------------------------------------------- safetensors

# Floating dtypes only: a quantized checkpoint (int / fp8 weights with scales) is not supported.
_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


@dataclasses.dataclass
class _TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


# Byte widths of every safetensors dtype (the header's sizes are checked for all of them; only
# _ST_DTYPES can be loaded).
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F4": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _read_header(path: str) -> dict[str, _TensorInfo]:
    """Parse and fully validate a safetensors header: every entry has a dtype, a shape of
    non-negative ints and data_offsets [begin, end] with begin <= end; the byte size is
    dtype x shape; the tensors tile the data area exactly (sorted by offset: contiguous, no
    overlap, no gap) and the data area ends where the file ends (a truncated file is named)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise WeightsError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 1 << 30:
                raise WeightsError(f"{path}: not a safetensors file (header length {n})")
            if 8 + n > size:
                raise WeightsError(f"{path}: truncated safetensors file: the header needs {8 + n} bytes, "
                                   f"the file has {size}")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise WeightsError(f"cannot read {path}: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: corrupt safetensors header: a JSON object expected, got {type(header).__name__}")
    out = {}
    base = 8 + n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        bad = f"{path}: corrupt safetensors header: tensor {name!r}"
        if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
            raise WeightsError(f"{bad} needs dtype, shape and data_offsets, got {meta!r:.120}")
        dtype, shape, offs = meta["dtype"], meta["shape"], meta["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ST_ITEMSIZE:
            raise WeightsError(f"{bad} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise WeightsError(f"{bad} has a bad shape {shape!r:.80} (a list of non-negative integers expected)")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)):
            raise WeightsError(f"{bad} has bad data_offsets {offs!r:.80} (two non-negative integers expected)")
        b, e = offs
        if b > e:
            raise WeightsError(f"{bad} has data_offsets [{b}, {e}] with begin > end")
        want = math.prod(shape) * _ST_ITEMSIZE[dtype]
        if e - b != want:
            raise WeightsError(f"{bad} has {e - b} bytes (data_offsets [{b}, {e}]) but shape {shape} {dtype} "
                               f"needs {want}")
        out[name] = _TensorInfo(path, dtype, tuple(shape), base + b, base + e)
    end = 0
    prev = None
    for name, info in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        b, e = info.begin - base, info.end - base
        if b < end:
            raise WeightsError(f"{path}: corrupt safetensors header: tensor {name!r} (data_offsets [{b}, {e}]) "
                               f"overlaps tensor {prev!r} (ends at {end})")
        if b > end:
            raise WeightsError(f"{path}: corrupt safetensors header: a gap of {b - end} bytes before tensor "
                               f"{name!r} (data_offsets [{b}, {e}]; the previous tensor ends at {end})")
        end, prev = e, name
    if base + end > size:
        last = [nm for nm, i in out.items() if i.end > size]
        raise WeightsError(f"{path}: truncated safetensors file: the tensors need {base + end} bytes, the file has "
                           f"{size} (tensor(s) past the end: {', '.join(sorted(last)[:5])})")
    if base + end < size:
        raise WeightsError(f"{path}: corrupt safetensors file: {size - base - end} bytes after the last tensor "
                           f"(the header accounts for {base + end} of {size} bytes)")
    return out


def _info_problem(name: str, info: _TensorInfo) -> str | None:
    dt = _ST_DTYPES.get(info.dtype)
    if dt is None:
        return f"{name}: unsupported dtype {info.dtype} (only F32/F16/BF16/F64; quantized checkpoints are not supported)"
    if info.end - info.begin != math.prod(info.shape) * dt.itemsize:
        return f"{name}: byte range {info.begin}..{info.end} does not hold shape {list(info.shape)} {info.dtype}"
    return None


def _view(mm: np.ndarray, info: _TensorInfo) -> np.ndarray:
    return mm[info.begin:info.end].view(_ST_DTYPES[info.dtype]).reshape(info.shape)


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (index order), or [path] for a single file."""
    if os.path.isfile(path):
        return [path]
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(idx):
        try:
            with open(idx, encoding="utf-8") as fh:
                index = json.load(fh)
        except json.JSONDecodeError as e:
            raise WeightsError(f"{idx}: not valid JSON ({e})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise WeightsError(f"{idx}: cannot be read ({e})") from None
        if not isinstance(index, dict):
            raise WeightsError(f"{idx}: a JSON object expected, got {type(index).__name__}")
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise WeightsError(f"{idx} has no weight_map (field 'weight_map' must be a non-empty object)")
        bad = [k for k, v in wm.items() if not isinstance(v, str) or not v]
        if bad:
            raise WeightsError(f"{idx}: field 'weight_map' must map tensor names to shard file names; "
                               f"bad entries for {', '.join(bad[:5])}")
        files = sorted(set(wm.values()))
        for f in files:
            why = _shard_escapes(path, f)
            if why:
                names = [k for k, v in wm.items() if v == f]
                raise WeightsError(f"{idx}: weight_map entry {names[0]!r}: {f!r} {why}; a shard must be a file "
                                   f"inside the checkpoint directory {path!r}")
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise WeightsError(f"shard file(s) named in {idx} do not exist: {', '.join(missing)}")
        by_file = {}  # "a.safetensors" and "./a.safetensors" are one shard, read once
        for f in files:
            by_file.setdefault(os.path.realpath(os.path.join(path, f)), os.path.join(path, os.path.normpath(f)))
        return sorted(by_file.values())
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        why = _shard_escapes(path, "model.safetensors")
        if why:  # the same rule as an index's entries: a checkpoint reads only files it holds
            raise WeightsError(f"{single} {why}; the weights must be a file inside the checkpoint directory "
                               f"{path!r}")
        return [single]
    raise WeightsError(f"no model.safetensors.index.json or model.safetensors in {path!r}")


def _shard_escapes(path: str, name: str) -> str | None:
    """Why a shard's file name (a weight_map entry, or the unindexed model.safetensors) leaves
    the checkpoint directory, or None. An index is data: an entry must not make the loader read files the checkpoint does not hold (../, an absolute path,
    a symlink out). One layout is let through: the Hugging Face hub cache, whose
    snapshots/<revision>/ files are symlinks to the same repository's blobs/."""
    if "\0" in name:  # no file name holds one (os.path would raise a bare "embedded null byte")
        return "holds a NUL character"
    if os.path.isabs(name) or os.path.splitdrive(name)[0]:
        return "is an absolute path"
    if ".." in re.split(r"[\\/]", name):
        return "climbs out with '..'"
    root = os.path.realpath(path)
    target = os.path.realpath(os.path.join(path, name))
    inside = lambda d: os.path.commonpath([d, target]) == d  # noqa: E731
    if inside(root):
        return None
    parent = os.path.dirname(root)
    if os.path.basename(parent) == "snapshots" and inside(os.path.join(os.path.dirname(parent), "blobs")):
        return None
    return f"is a symlink to {target}, outside it"


# ----------------------------------------------------------------------------- the name table

@dataclasses.dataclass(frozen=True)
class _Dims:
    """Config sizes under short names (used by the table's shape/placement functions)."""
    D: int; V: int; E: int; I: int; Is: int; H: int; Hkv: int; hd: int
    nk: int; dk: int; nv: int; dv: int; C: int; K: int

    @staticmethod
    def of(cfg: Config) -> "_Dims":
        return _Dims(D=cfg.hidden_size, V=cfg.vocab_size, E=cfg.num_experts, I=cfg.moe_inter, Is=cfg.shared_inter,
                     H=cfg.num_heads, Hkv=cfg.num_kv_heads, hd=cfg.head_dim, nk=cfg.lin_k_heads, dk=cfg.lin_k_dim,
                     nv=cfg.lin_v_heads, dv=cfg.lin_v_dim, C=cfg.conv_dim, K=cfg.conv_kernel)

    @property
    def kd(self): return self.nk * self.dk

    @property
    def vd(self): return self.nv * self.dv

    @property
    def qr(self): return 2 * self.H * self.hd  # q_proj rows (query and gate interleaved per head)


def _rows(a: int, b: int) -> Callable:
    def put(buf, x):
        buf[a:b] = x
    return put


def _expert_rows(e: int, a: int, b: int) -> Callable:
    def put(buf, x):
        buf[e, a:b] = x
    return put


def _regroup_qkvz(c: _Dims) -> Callable:
    """in_proj_qkvz rows, per key head g: [q dk | k dk | v r*dv | z r*dv] (r = nv/nk) -> flat rows
    [q all heads | k all heads | v all heads | z all heads] (the first conv_dim + nv*dv rows of in_proj).
    Mirrors transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering."""
    nk, dk, dv, r, kd, vd = c.nk, c.dk, c.dv, c.nv // c.nk, c.kd, c.vd

    def put(buf, x):
        g = x.reshape(nk, 2 * dk + 2 * r * dv, x.shape[-1])
        buf[0:kd] = g[:, 0:dk].reshape(kd, -1)
        buf[kd:2 * kd] = g[:, dk:2 * dk].reshape(kd, -1)
        buf[2 * kd:2 * kd + vd] = g[:, 2 * dk:2 * dk + r * dv].reshape(vd, -1)
        buf[2 * kd + vd:2 * kd + 2 * vd] = g[:, 2 * dk + r * dv:].reshape(vd, -1)
    return put


def _regroup_ba(c: _Dims) -> Callable:
    """in_proj_ba rows, per key head g: [b r | a r] -> flat b (nv rows) then flat a (nv rows),
    the last 2*nv rows of in_proj."""
    nk, nv, r, off = c.nk, c.nv, c.nv // c.nk, c.C + c.vd

    def put(buf, x):
        g = x.reshape(nk, 2 * r, x.shape[-1])
        buf[off:off + nv] = g[:, 0:r].reshape(nv, -1)
        buf[off + nv:off + 2 * nv] = g[:, r:].reshape(nv, -1)
    return put


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One row of the table: a layer-local HF name template, when it applies, where it goes."""
    template: str               # relative to "<prefix>layers.<i>."; "{e}" = expert index
    mixer: str                  # "any", "attn" or "gdn"
    layout: str                 # "any", "fused"/"per_expert" (experts), "flat"/"grouped" (gdn in_proj)
    target: tuple[str, ...]     # path inside the layer dict
    shape: Callable             # (dims) -> the checkpoint tensor's shape
    put: Callable | None = None  # (dims, e) -> f(buf, x) writing into the target; None = the whole target
    reshape: bool = False       # whole target, reshaped (conv1d [C,1,K] -> [C,K])


_LAYER_TABLE: tuple[_Rule, ...] = (
    _Rule("input_layernorm.weight", "any", "any", ("in_norm",), lambda c: (c.D,)),
    _Rule("post_attention_layernorm.weight", "any", "any", ("post_norm",), lambda c: (c.D,)),
    # MoE
    _Rule("mlp.gate.weight", "any", "any", ("moe", "router"), lambda c: (c.E, c.D)),
    _Rule("mlp.experts.gate_up_proj", "any", "fused", ("moe", "gate_up"), lambda c: (c.E, 2 * c.I, c.D)),
    _Rule("mlp.experts.down_proj", "any", "fused", ("moe", "down"), lambda c: (c.E, c.D, c.I)),
    _Rule("mlp.experts.{e}.gate_proj.weight", "any", "per_expert", ("moe", "gate_up"), lambda c: (c.I, c.D),
          lambda c, e: _expert_rows(e, 0, c.I)),
    _Rule("mlp.experts.{e}.up_proj.weight", "any", "per_expert", ("moe", "gate_up"), lambda c: (c.I, c.D),
          lambda c, e: _expert_rows(e, c.I, 2 * c.I)),
    _Rule("mlp.experts.{e}.down_proj.weight", "any", "per_expert", ("moe", "down"), lambda c: (c.D, c.I),
          lambda c, e: _expert_rows(e, 0, c.D)),
    _Rule("mlp.shared_expert.gate_proj.weight", "any", "any", ("moe", "shared_gate_up"), lambda c: (c.Is, c.D),
          lambda c, e: _rows(0, c.Is)),
    _Rule("mlp.shared_expert.up_proj.weight", "any", "any", ("moe", "shared_gate_up"), lambda c: (c.Is, c.D),
          lambda c, e: _rows(c.Is, 2 * c.Is)),
    _Rule("mlp.shared_expert.down_proj.weight", "any", "any", ("moe", "shared_down"), lambda c: (c.D, c.Is)),
    _Rule("mlp.shared_expert_gate.weight", "any", "any", ("moe", "shared_gate"), lambda c: (1, c.D)),
    # gated attention: qkv = q_proj rows (per head [query hd | gate hd]), then k_proj, then v_proj
    _Rule("self_attn.q_proj.weight", "attn", "any", ("attn", "qkv"), lambda c: (c.qr, c.D),
          lambda c, e: _rows(0, c.qr)),
    _Rule("self_attn.k_proj.weight", "attn", "any", ("attn", "qkv"), lambda c: (c.Hkv * c.hd, c.D),
          lambda c, e: _rows(c.qr, c.qr + c.Hkv * c.hd)),
    _Rule("self_attn.v_proj.weight", "attn", "any", ("attn", "qkv"), lambda c: (c.Hkv * c.hd, c.D),
          lambda c, e: _rows(c.qr + c.Hkv * c.hd, c.qr + 2 * c.Hkv * c.hd)),
    _Rule("self_attn.o_proj.weight", "attn", "any", ("attn", "o"), lambda c: (c.D, c.H * c.hd)),
    _Rule("self_attn.q_norm.weight", "attn", "any", ("attn", "q_norm"), lambda c: (c.hd,)),
    _Rule("self_attn.k_norm.weight", "attn", "any", ("attn", "k_norm"), lambda c: (c.hd,)),
    # gated deltanet: in_proj = flat [q | k | v] (conv_dim rows), then z (nv*dv), then b (nv), then a (nv)
    _Rule("linear_attn.in_proj_qkv.weight", "gdn", "flat", ("gdn", "in_proj"), lambda c: (c.C, c.D),
          lambda c, e: _rows(0, c.C)),
    _Rule("linear_attn.in_proj_z.weight", "gdn", "flat", ("gdn", "in_proj"), lambda c: (c.vd, c.D),
          lambda c, e: _rows(c.C, c.C + c.vd)),
    _Rule("linear_attn.in_proj_b.weight", "gdn", "flat", ("gdn", "in_proj"), lambda c: (c.nv, c.D),
          lambda c, e: _rows(c.C + c.vd, c.C + c.vd + c.nv)),
    _Rule("linear_attn.in_proj_a.weight", "gdn", "flat", ("gdn", "in_proj"), lambda c: (c.nv, c.D),
          lambda c, e: _rows(c.C + c.vd + c.nv, c.C + c.vd + 2 * c.nv)),
    _Rule("linear_attn.in_proj_qkvz.weight", "gdn", "grouped", ("gdn", "in_proj"), lambda c: (2 * c.kd + 2 * c.vd, c.D),
          lambda c, e: _regroup_qkvz(c)),
    _Rule("linear_attn.in_proj_ba.weight", "gdn", "grouped", ("gdn", "in_proj"), lambda c: (2 * c.nv, c.D),
          lambda c, e: _regroup_ba(c)),
    _Rule("linear_attn.conv1d.weight", "gdn", "any", ("gdn", "conv"), lambda c: (c.C, 1, c.K), reshape=True),
    _Rule("linear_attn.A_log", "gdn", "any", ("gdn", "A_log"), lambda c: (c.nv,)),
    _Rule("linear_attn.dt_bias", "gdn", "any", ("gdn", "dt_bias"), lambda c: (c.nv,)),
    _Rule("linear_attn.norm.weight", "gdn", "any", ("gdn", "norm"), lambda c: (c.dv,)),
    _Rule("linear_attn.out_proj.weight", "gdn", "any", ("gdn", "out"), lambda c: (c.D, c.vd)),
)

_LAYER_RE = [(re.compile(re.escape(r.template).replace(re.escape("{e}"), r"(\d+)") + "$"), r) for r in _LAYER_TABLE]

# Names never loaded.
_IGNORE_RE = re.compile(r"^(mtp\.|model\.visual\.)")
_PREFIXES = ("model.language_model.", "model.")


@dataclasses.dataclass
class _Source:
    """An expected checkpoint tensor: its shape and how it is written into its target."""
    name: str
    target: tuple            # ("embed",) / ("layers", i, "moe", "gate_up") ...
    shape: tuple[int, ...]
    put: Callable | None     # None: the whole target (after reshape to the target shape if reshape)
    reshape: bool = False


def param_shapes(cfg: Config) -> dict:
    """The params tree's shapes: same structure as the params, leaves are (shape, is_f32)."""
    c = _Dims.of(cfg)
    layers = []
    for lt in cfg.layer_types:
        layer = {
            "in_norm": ((c.D,), True), "post_norm": ((c.D,), True),
            "moe": {"router": ((c.E, c.D), False), "gate_up": ((c.E, 2 * c.I, c.D), False),
                    "down": ((c.E, c.D, c.I), False), "shared_gate_up": ((2 * c.Is, c.D), False),
                    "shared_down": ((c.D, c.Is), False), "shared_gate": ((1, c.D), False)},
        }
        if lt == FULL:
            layer["attn"] = {"qkv": ((cfg.attn_qkv_dim, c.D), False), "o": ((c.D, c.H * c.hd), False),
                             "q_norm": ((c.hd,), True), "k_norm": ((c.hd,), True)}
        else:
            layer["gdn"] = {"in_proj": ((cfg.gdn_in_dim, c.D), False), "conv": ((c.C, c.K), False),
                            "A_log": ((c.nv,), True), "dt_bias": ((c.nv,), True), "norm": ((c.dv,), True),
                            "out": ((c.D, c.vd), False)}
        layers.append(layer)
    return {"embed": ((c.V, c.D), False), "final_norm": ((c.D,), True), "lm_head": ((c.V, c.D), False),
            "layers": tuple(layers)}


def _layer_sources(cfg: Config, i: int, prefix: str, expert_layout: str, gdn_layout: str) -> list[_Source]:
    c = _Dims.of(cfg)
    mixer = "attn" if cfg.layer_types[i] == FULL else "gdn"
    out = []
    base = f"{prefix}layers.{i}."
    for rule in _LAYER_TABLE:
        if rule.mixer not in ("any", mixer):
            continue
        if rule.layout in ("fused", "per_expert") and rule.layout != expert_layout:
            continue
        if rule.layout in ("flat", "grouped") and rule.layout != gdn_layout:
            continue
        target = ("layers", i) + rule.target
        shape = tuple(rule.shape(c))
        for e in (range(c.E) if "{e}" in rule.template else [None]):
            name = base + (rule.template.format(e=e) if e is not None else rule.template)
            put = rule.put(c, e) if rule.put is not None else None
            out.append(_Source(name, target, shape, put, rule.reshape))
    return out


def _unknown_reason(name: str, prefix: str, cfg: Config) -> str:
    """A short hint for an unexpected tensor name."""
    if not name.startswith(prefix) and name != "lm_head.weight":
        return f"outside the detected prefix {prefix!r}"
    m = re.match(re.escape(prefix) + r"layers\.(\d+)\.(.+)$", name)
    if not m:
        return "not a known top-level tensor"
    i, local = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers:
        return f"layer {i} >= num_hidden_layers {cfg.num_layers}"
    for rx, rule in _LAYER_RE:
        mm = rx.match(local)
        if mm:
            if rule.mixer != "any" and rule.mixer != ("attn" if cfg.layer_types[i] == FULL else "gdn"):
                return f"layer {i} is {cfg.layer_types[i]}"
            if "{e}" in rule.template and int(mm.group(1)) >= cfg.num_experts:
                return f"expert index >= num_experts {cfg.num_experts}"
            return f"layer {i} mixes {rule.layout} and another layout"
    return "no rule matches it"


def _plan(names: dict[str, tuple[int, ...]], cfg: Config) -> list[_Source]:
    """Check names/shapes against cfg (all problems at once); the list of sources to load."""
    present = set(names)
    ignored = {n for n in present if _IGNORE_RE.match(n)}
    if cfg.tie_word_embeddings and "lm_head.weight" in present:
        ignored.add("lm_head.weight")
    if any(n.startswith(_PREFIXES[0]) for n in present - ignored):
        prefix = _PREFIXES[0]
    else:
        prefix = _PREFIXES[1]

    D, V = cfg.hidden_size, cfg.vocab_size
    sources = [
        _Source(prefix + "embed_tokens.weight", ("embed",), (V, D), None),
        _Source(prefix + "norm.weight", ("final_norm",), (D,), None),
    ]
    if not cfg.tie_word_embeddings:
        sources.append(_Source("lm_head.weight", ("lm_head",), (V, D), None))
    for i in range(cfg.num_layers):
        base = f"{prefix}layers.{i}."
        fused = any(base + t in present for t in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        grouped = any(base + t in present for t in ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"))
        sources += _layer_sources(cfg, i, prefix, "fused" if fused else "per_expert", "grouped" if grouped else "flat")

    expected = {s.name: s for s in sources}
    missing = [s.name for s in sources if s.name not in present]
    unknown = sorted(present - ignored - set(expected))
    bad_shape = [(n, names[n], expected[n].shape) for n in expected if n in present and tuple(names[n]) != expected[n].shape]
    if missing or unknown or bad_shape:
        lines = [f"checkpoint does not match the {cfg.model_type} config "
                 f"({len(missing)} missing, {len(unknown)} unexpected, {len(bad_shape)} mis-shaped tensor(s); prefix {prefix!r}):"]
        if missing:
            lines.append(f"missing tensor(s) ({len(missing)}):")
            lines += [f"  {n}" for n in missing]
        if unknown:
            lines.append(f"unexpected tensor(s) ({len(unknown)}):")
            lines += [f"  {n}  ({_unknown_reason(n, prefix, cfg)})" for n in unknown]
        if bad_shape:
            lines.append(f"mis-shaped tensor(s) ({len(bad_shape)}):")
            lines += [f"  {n}: shape {list(got)}, expected {list(want)}" for n, got, want in bad_shape]
        raise WeightsError("\n".join(lines))
    return sources


# ----------------------------------------------------------------------------- assembly


class _Assembler:
    """Collects sources into targets; puts a target on the device as soon as it is complete."""

    def __init__(self, cfg: Config, sources: list[_Source], dtype, place: Callable | None = None,
                 check_finite: bool = True):
        self.cfg = cfg
        self.place = place  # (target, numpy array) -> the stored array; None: the default device
        self.check_finite = check_finite
        self.finite_flags: list[tuple[tuple, Any]] = []  # (target, "has a non-finite value" bool array)
        self.sources_of: dict[tuple, list[str]] = {}
        self.dtype = jnp.dtype(dtype)
        self.np_dtype = np.dtype(self.dtype)
        shapes = param_shapes(cfg)
        self.pending: dict[tuple, set[str]] = {}
        self.by_name: dict[str, _Source] = {}
        self.target_info: dict[tuple, tuple[tuple[int, ...], bool]] = {}
        for s in sources:
            self.by_name[s.name] = s
            self.pending.setdefault(s.target, set()).add(s.name)
            self.sources_of.setdefault(s.target, []).append(s.name)
            node = shapes
            for k in s.target:
                node = node[k]
            self.target_info[s.target] = node
        self.buffers: dict[tuple, np.ndarray] = {}
        self.done: dict[tuple, jax.Array] = {}

    def _finish(self, target, arr: np.ndarray):
        shape, f32 = self.target_info[target]
        assert arr.shape == shape, (target, arr.shape, shape)
        stored = self.place(target, arr) if self.place else jax.device_put(arr)
        self.done[target] = stored
        if self.check_finite:  # one reduction per tensor where it lives; read back once, in nonfinite()
            self.finite_flags.append((target, _any_nonfinite(stored) if _on_device(stored)
                                      else np.bool_(not np.isfinite(arr).all())))

    def nonfinite(self, reader: Callable[[str], np.ndarray] | None = None) -> list[str]:
        """Names of the checkpoint tensors holding NaN/Inf (after conversion to the load dtype):
        the flagged targets' sources, narrowed by `reader(name)` to the guilty ones where given."""
        if not self.finite_flags:
            return []
        flags = jax.device_get([f for _, f in self.finite_flags])
        out = []
        for (target, _), bad in zip(self.finite_flags, flags):
            if not bad:
                continue
            names = self.sources_of[target]
            guilty = [n for n in names if not np.isfinite(reader(n)).all()] if reader and len(names) > 1 else []
            out += guilty or names
        return out

    def add(self, name: str, x: np.ndarray):
        s = self.by_name[name]
        shape, f32 = self.target_info[s.target]
        dt = np.dtype(np.float32) if f32 else self.np_dtype
        if s.put is None:
            if s.reshape:
                x = x.reshape(shape)
            # astype copies: never hand a view of the memory map to the device (the CPU client may alias it)
            self._finish(s.target, x.astype(dt, copy=True))
        else:
            buf = self.buffers.get(s.target)
            if buf is None:
                buf = self.buffers[s.target] = np.empty(shape, dt)
            s.put(buf, x)  # numpy casts on assignment (round to nearest even for bf16)
        left = self.pending[s.target]
        left.discard(name)
        if not left and s.put is not None:
            self._finish(s.target, self.buffers.pop(s.target))

    def params(self):
        if any(self.pending.values()) or self.buffers:
            raise WeightsError(f"internal error: incomplete targets {[t for t, v in self.pending.items() if v]}")
        d = self.done
        layers = []
        for i in range(self.cfg.num_layers):
            layer: dict[str, Any] = {}
            for t, arr in d.items():
                if t[0] == "layers" and t[1] == i:
                    node = layer
                    for k in t[2:-1]:
                        node = node.setdefault(k, {})
                    node[t[-1]] = arr
            layers.append(layer)
        embed = d[("embed",)]
        return {"embed": embed, "final_norm": d[("final_norm",)],
                "lm_head": embed if self.cfg.tie_word_embeddings else d[("lm_head",)],
                "layers": tuple(layers)}


_any_nonfinite = jax.jit(lambda x: jnp.any(~jnp.isfinite(x)))


def _on_device(x) -> bool:
    """A jax array in its device's default memory (not a host memory kind, not numpy)."""
    if not isinstance(x, jax.Array):
        return False
    try:
        dev = next(iter(x.devices()))
        return x.sharding.memory_kind in (None, dev.default_memory().kind)
    except Exception:  # a backend without memory kinds
        return True


def allow_nonfinite_env() -> bool:
    """The allow_nonfinite setting from the environment (BARO_ALLOW_NONFINITE, parsed strictly)."""
    return Settings.resolve().allow_nonfinite


def _allow_nonfinite(v) -> bool:
    """The allow_nonfinite argument: a boolean, or None for the environment. Not truthiness: the
    string "false" must not load NaN weights."""
    if v is None:
        return allow_nonfinite_env()
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise TypeError(f"allow_nonfinite (--allow-nonfinite) must be True, False or None (the environment), "
                    f"got {type(v).__name__} {v!r}")


def _refuse_nonfinite(names: list[str], where: str):
    if names:
        shown = "\n".join(f"  {n}" for n in names[:20]) + (f"\n  ... and {len(names) - 20} more" if len(names) > 20 else "")
        raise WeightsError(f"{where}: {len(names)} tensor(s) hold NaN or Inf values (a model with them decodes "
                           f"garbage):\n{shown}\nrefusing to load; pass allow_nonfinite=True (CLI --allow-nonfinite, "
                           f"env BARO_ALLOW_NONFINITE=1) to load it anyway")


LOAD_DTYPES = ("bfloat16", "float32")


def _load_dtype(dtype):
    """The load dtype, bfloat16 or float32, given by name or as a dtype. Anything else is refused,
    not converted: jnp.dtype would take "half" as float16 and None as float64."""
    name = dtype if isinstance(dtype, str) else None
    if name is None and dtype is not None:
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            pass
    if name not in LOAD_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(LOAD_DTYPES)} (a name or a dtype), got {dtype!r}")
    return jnp.dtype(name)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def load_params(path: str, cfg: Config, dtype=jnp.bfloat16, progress: bool = True, place: Callable | None = None,
                allow_nonfinite: bool | None = None):
    """Read a checkpoint (directory with model.safetensors[.index.json], or one .safetensors file)
    into the params tree (see module docstring). Raises WeightsError naming every missing,
    unexpected or mis-shaped tensor before reading any data, and, after reading, every tensor
    holding NaN/Inf unless allow_nonfinite (None: env BARO_ALLOW_NONFINITE). `place(target, array)`
    stores each finished tensor (tier mode puts routed experts in host memory); default: the
    default device."""
    dtype = _load_dtype(dtype)
    allow_nonfinite = _allow_nonfinite(allow_nonfinite)
    t0 = time.time()
    files = checkpoint_files(path)
    infos: dict[str, _TensorInfo] = {}
    dups = []
    for f in files:
        for name, info in _read_header(f).items():
            if name in infos:
                dups.append(f"{name} ({os.path.basename(infos[name].file)} and {os.path.basename(f)})")
            infos[name] = info
    if dups:
        raise WeightsError("tensor(s) stored in more than one shard: " + ", ".join(dups))
    sources = _plan({n: i.shape for n, i in infos.items()}, cfg)
    wanted = {s.name for s in sources}
    bad = [p for p in (_info_problem(n, infos[n]) for n in sorted(wanted)) if p]
    if bad:
        raise WeightsError(f"unreadable tensor(s) ({len(bad)}):\n" + "\n".join("  " + p for p in bad))
    asm = _Assembler(cfg, sources, dtype, place, check_finite=not allow_nonfinite)
    total = sum(infos[n].end - infos[n].begin for n in wanted)
    done_bytes = 0
    for k, f in enumerate(files):
        names = sorted((n for n, i in infos.items() if i.file == f and n in wanted), key=lambda n: infos[n].begin)
        if not names:
            continue
        mm = np.memmap(f, dtype=np.uint8, mode="r")
        nbytes = 0
        for n in names:
            info = infos[n]
            asm.add(n, _view(mm, info))
            nbytes += info.end - info.begin
        del mm
        done_bytes += nbytes
        if progress:
            print(f"[baro_jax] shard {k + 1}/{len(files)} {os.path.basename(f)}: {len(names)} tensors, "
                  f"{_fmt_bytes(nbytes)}; {_fmt_bytes(done_bytes)}/{_fmt_bytes(total)} in {time.time() - t0:.1f}s",
                  file=sys.stderr, flush=True)
    params = asm.params()

    def reader(name):
        info = infos[name]
        return _view(np.memmap(info.file, dtype=np.uint8, mode="r"), info)

    _refuse_nonfinite(asm.nonfinite(reader), path)
    if progress:
        print(f"[baro_jax] loaded {len(wanted)} tensors ({_fmt_bytes(total)}) as {jnp.dtype(dtype).name} "
              f"in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    return params


def _to_numpy(v) -> np.ndarray:
    if hasattr(v, "detach") and hasattr(v, "dtype"):  # a torch tensor (torch is not imported here)
        v = v.detach().cpu()
        if str(v.dtype) == "torch.bfloat16":
            import torch
            return v.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return v.numpy()
    return np.asarray(v)


def params_from_state_dict(state: dict[str, Any], cfg: Config, dtype=jnp.bfloat16, allow_nonfinite: bool | None = None):
    """Same as load_params, from an in-memory {hf_name: array} dict (numpy arrays, torch tensors,
    or anything np.asarray takes), e.g. ``model.state_dict()`` of a transformers model."""
    dtype = _load_dtype(dtype)
    allow_nonfinite = _allow_nonfinite(allow_nonfinite)
    arrays = {k: _to_numpy(v) for k, v in state.items()}
    sources = _plan({k: tuple(v.shape) for k, v in arrays.items()}, cfg)
    asm = _Assembler(cfg, sources, dtype, check_finite=not allow_nonfinite)
    for s in sources:
        asm.add(s.name, arrays[s.name])
    params = asm.params()
    _refuse_nonfinite(asm.nonfinite(lambda n: arrays[n]), "state dict")
    return params
