"""The GPU scratch sizes, from the kernel library itself.

csrc/common/scratch_layout.h is the one definition of the scratch layouts: the GPU handlers lay
their scratch out with it, and the CPU library (always built) exports its sizes as C functions,
called here through ctypes. The _small ops size their scratch results with them and
baro_jax.budget plans the MoE's allocator scratch with them, so neither can drift from the
kernels.
"""
from __future__ import annotations

import ctypes

from . import _lib

_I64 = ctypes.c_int64
_INT = ctypes.c_int
_FUNCS = {
    "moe": ("baro_moe_scratch_bytes", ("m", "E", "k", "I", "Is", "D"), ("fold", "fused", "tail", "stage")),
    "attention": ("baro_attention_scratch_bytes", ("m", "S", "H", "Hkv", "hd"), ("hip",)),
}
_bound: dict[str, object] = {}


def _fn(op: str):
    if op not in _bound:
        _lib.load()
        lib = _lib._libs.get("cpu")
        if lib is None:
            raise RuntimeError(f"custom_calls.scratch_bytes: {_lib.BUILD_HINT['cpu']} "
                               f"[{_lib.load_errors().get('cpu', '')}]")
        sym, ints, flags = _FUNCS[op]
        f = getattr(lib, sym, None)
        if f is None:
            raise RuntimeError(f"custom_calls.scratch_bytes: {_lib.library_paths()['cpu']} has no {sym} "
                               "(a library built before it: rebuild, see BUILD.md)")
        f.restype = _I64
        f.argtypes = [_I64] * len(ints) + [_INT] * len(flags)
        _bound[op] = f
    return _bound[op]


def scratch_bytes(op: str, **dims) -> int:
    """Bytes of GPU scratch one call of `op` takes, as the kernels lay it out.

    op "moe" (baro_moe, _slots, _host): m, E, k, I, Is, D and the plan's pieces fold, fused,
    tail, stage (csrc/gpu/moe.cu moe_plan decides them per call; see scratch_layout.h
    MoePlanFlags). op "attention": m, S, H, Hkv, hd and hip (the HIP kernel's layout instead of
    CUDA's); 0 for calls of more than 16 rows, which take none."""
    if op not in _FUNCS:
        raise ValueError(f"custom_calls.scratch_bytes: op must be one of {', '.join(_FUNCS)}, got {op!r}")
    _, ints, flags = _FUNCS[op]
    want = set(ints) | set(flags)
    if set(dims) != want:
        missing, extra = sorted(want - set(dims)), sorted(set(dims) - want)
        raise TypeError(f"custom_calls.scratch_bytes({op!r}): takes {', '.join(ints + flags)}"
                        + (f"; missing {', '.join(missing)}" if missing else "")
                        + (f"; unknown {', '.join(extra)}" if extra else ""))
    args = []
    for name in ints:
        v = dims[name]
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise TypeError(f"custom_calls.scratch_bytes({op!r}): {name} must be an int, got {type(v).__name__}")
        v = int(v)
        if not 0 <= v < 2 ** 31:
            raise ValueError(f"custom_calls.scratch_bytes({op!r}): {name} must be in [0, 2**31), got {v}")
        args.append(v)
    args += [1 if dims[name] else 0 for name in flags]
    n = int(_fn(op)(*args))
    if n < 0:
        raise ValueError(f"custom_calls.scratch_bytes({op!r}): the library refused {dims}")
    return n
