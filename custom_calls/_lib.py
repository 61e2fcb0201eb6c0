"""Finds and loads the baro kernel libraries and registers their FFI targets.

libbaro_cpu.so  -> platform "cpu"   (symbols Baro<Op>Cpu)
libbaro_cuda.so -> platform "CUDA"  (symbols Baro<Op>Gpu)
libbaro_hip.so  -> platform "ROCM"  (symbols Baro<Op>Gpu)

When a GPU library is absent, its platform gets a stub handler from the CPU
library that fails with a message saying how to build it (see BUILD.md).
"""

from __future__ import annotations

import ctypes
import os
import site
import sys
import sysconfig
import threading
from pathlib import Path

import jax
import numpy as np

from . import knobs

# FFI target name -> symbol stem (symbol = stem + "Cpu" / "Gpu").
TARGETS = {
    "baro_matmul": "BaroMatmul",
    "baro_rmsnorm": "BaroRmsnorm",
    "baro_add_rmsnorm": "BaroAddRmsnorm",  # the residual add before a norm, one call
    "baro_gated_norm": "BaroGatedNorm",
    "baro_attention": "BaroAttention",
    "baro_attention_small": "BaroAttentionSmall",  # m <= 16 with its scratch as a result (command buffers)
    "baro_conv": "BaroConv",
    "baro_conv_proj": "BaroConvProj",  # baro_conv reading its input from the f32 GDN projection
    "baro_delta": "BaroDelta",
    "baro_delta_blocked": "BaroDeltaBlocked",
    "baro_moe": "BaroMoe",
    "baro_moe_small": "BaroMoeSmall",  # m <= 16 with its scratch as a result (command buffers)
    "baro_moe_slots": "BaroMoeSlots",  # baro_moe through a slot table (tier decode cache)
    "baro_moe_slots_small": "BaroMoeSlotsSmall",
    "baro_moe_host_small": "BaroMoeHostSmall",  # tier decode: experts with no slot read from the host store
    "baro_moe_route": "BaroMoeRoute",  # baro_moe's routing alone: expert ids [m, top_k]
    "baro_moe_pairs": "BaroMoePairs",  # expert parallel: routing + this shard's per-pair outputs
    "baro_moe_combine": "BaroMoeCombine",  # expert parallel: baro_moe's combine of given pairs
    "baro_fetch_experts": "BaroFetchExperts",  # tier decode: pool[slot] = store[expert] by the copy engines
    "baro_attention_rows": "BaroAttentionRows",  # many sequences: each row its own slot of a KV pool
    "baro_log_softmax": "BaroLogSoftmax",  # row-wise log-softmax in a fixed order (logprobs)
    "baro_topk_rows": "BaroTopkRows",  # each row's k largest logits (sampling's top_k in the decode graph)
}

# Targets with a CPU kernel only: on a GPU platform whose library does not export them, a stub
# from the CPU library is registered that fails with "no GPU kernel yet" (not "rebuild").
# Empty now: baro_delta_blocked has its GPU kernel (csrc/gpu/delta_blocked.cu), so a GPU library
# without BaroDeltaBlockedGpu is a stale build and gets the "rebuild" message.
CPU_ONLY: dict[str, str] = {}
NO_GPU_KERNEL: dict[str, str] = {}

# XLA platform name -> (library file, symbol suffix, stub symbol in the CPU lib)
LIBRARIES = {
    "cpu": ("libbaro_cpu.so", "Cpu", None),
    "CUDA": ("libbaro_cuda.so", "Gpu", "BaroMissingCuda"),
    "ROCM": ("libbaro_hip.so", "Gpu", "BaroMissingHip"),
}

BUILD_HINT = {
    "cpu": ("the CPU library libbaro_cpu.so was not found; build it with "
            "`pip install --no-build-isolation --no-deps -e .` (or `pip install .`) "
            "from the baro_jax checkout (see BUILD.md)"),
    "CUDA": ("the CUDA library libbaro_cuda.so was not built; rebuild with nvcc on "
             "PATH: `BARO_GPU=cuda pip install --no-build-isolation --no-deps -e .` "
             "(see BUILD.md)"),
    "ROCM": ("the HIP library libbaro_hip.so was not built; rebuild with hipcc on "
             "PATH: `BARO_GPU=hip pip install --no-build-isolation --no-deps -e .` "
             "(see BUILD.md)"),
}

_lock = threading.Lock()
_loaded = False
_libs: dict[str, ctypes.CDLL] = {}
_paths: dict[str, str] = {}
_errors: dict[str, str] = {}
# platform -> (path, the loader's error) of a library file that exists but failed to load
_broken: dict[str, tuple[str, str]] = {}
# platform -> set of targets registered with a real handler
_registered: dict[str, set[str]] = {}


def search_dirs() -> list[Path]:
    """Directories searched for the libraries, in order."""
    dirs: list[Path] = []
    env = os.environ.get("BARO_LIB_DIR")
    if env:
        dirs.append(Path(env))
    here = Path(__file__).resolve().parent
    dirs.append(here)
    pkg = sys.modules.get(__package__ or "custom_calls")
    for p in getattr(pkg, "__path__", []) or []:
        dirs.append(Path(p))
    roots: list[str] = []
    try:
        roots += site.getsitepackages()
    except AttributeError:  # some virtualenvs
        pass
    try:
        roots.append(site.getusersitepackages())
    except AttributeError:
        pass
    for key in ("purelib", "platlib"):
        try:
            roots.append(sysconfig.get_paths()[key])
        except KeyError:
            pass
    for r in roots:
        dirs.append(Path(r) / "custom_calls")
    out: list[Path] = []
    for d in dirs:
        try:
            d = d.resolve()
        except OSError:
            continue
        if d not in out:
            out.append(d)
    return out


def _find(filename: str) -> Path | None:
    for d in search_dirs():
        f = d / filename
        if f.is_file():
            return f
    return None


def _load_library(platform: str) -> None:
    filename = LIBRARIES[platform][0]
    path = _find(filename)
    if path is None:
        _errors[platform] = f"{filename} not found in {[str(d) for d in search_dirs()]}"
        return
    try:
        _libs[platform] = ctypes.CDLL(str(path))
        _paths[platform] = str(path)
    except OSError as e:  # a damaged file, the wrong architecture, a GPU runtime library missing
        _errors[platform] = f"{path} could not be loaded: {e}"
        _broken[platform] = (str(path), str(e))


def load() -> None:
    """Loads the libraries and registers all targets (idempotent)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        for platform in LIBRARIES:
            _load_library(platform)
        cpu = _libs.get("cpu")
        for platform, (_, suffix, stub) in LIBRARIES.items():
            lib = _libs.get(platform)
            done = _registered.setdefault(platform, set())
            for target, stem in TARGETS.items():
                fn = None
                if lib is not None:
                    fn = getattr(lib, stem + suffix, None)
                    if fn is None and target in CPU_ONLY and platform != "cpu":
                        if cpu is not None:  # a clear "no GPU kernel yet" at run time, not a missing handler
                            fn = getattr(cpu, CPU_ONLY[target], None)
                    elif fn is None:
                        _errors.setdefault(platform, "")
                        _errors[platform] += f" missing symbol {stem + suffix};"
                    else:
                        done.add(target)
                if fn is None and stub is not None and cpu is not None and lib is None:
                    fn = getattr(cpu, stub, None)
                if fn is not None:
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn),
                                                platform=platform)


def available_platforms() -> list[str]:
    """XLA platforms ("cpu", "CUDA", "ROCM") with a real kernel library loaded."""
    load()
    return [p for p in LIBRARIES if p in _libs]


def library_paths() -> dict[str, str]:
    """Platform -> path of the loaded library."""
    load()
    return dict(_paths)


def broken_libraries() -> dict[str, tuple[str, str]]:
    """Platform -> (path, loader error) of each library file that is there but would not load
    (as opposed to one that was never built)."""
    load()
    return dict(_broken)


class LibraryLoadError(ImportError):
    """The CPU kernel library is missing (broken=False) or is there but will not load
    (broken=True: path and error say which file and why)."""

    def __init__(self, msg: str, path: str | None = None, error: str | None = None, broken: bool = False):
        super().__init__(msg)
        self.path, self.error, self.broken = path, error, broken


def load_errors() -> dict[str, str]:
    """Platform -> why its library is not (fully) available."""
    load()
    return dict(_errors)


def _array_platforms(args) -> set[str]:
    """XLA platform names of the concrete jax arrays among args."""
    plats: set[str] = set()
    for a in args:
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            try:
                devs = a.devices()
            except Exception:  # noqa: BLE001 - deleted/odd arrays: let XLA decide
                continue
            for d in devs:
                plats.add(_xla_platform(d))
    return plats


def _xla_platform(device) -> str:
    p = device.platform.lower()
    if p == "cpu":
        return "cpu"
    if p in ("cuda", "rocm"):
        return p.upper()
    if p == "gpu":
        ver = str(getattr(device.client, "platform_version", "")).lower()
        return "ROCM" if "rocm" in ver or "hip" in ver else "CUDA"
    return p


def gpu_platform(args) -> str | None:
    """The GPU platform ("CUDA" or "ROCM") a call on these args runs on, None for the CPU: the
    concrete arrays' platform, or inside jit (tracers only) the default device's
    (`jax.default_device`'s when set)."""
    plats = _array_platforms(args)
    if not plats:
        try:
            dev = jax.config.jax_default_device
            if isinstance(dev, str):
                dev = jax.devices(dev)[0]
            plats = {_xla_platform(dev if dev is not None else jax.devices()[0])}
        except Exception:  # noqa: BLE001
            return None
    gpus = sorted(p for p in plats if p in ("CUDA", "ROCM"))
    return gpus[0] if gpus else None


def check_gpu_limits(target: str, args, limits) -> None:
    """Refuses, before lowering, a call the GPU kernels cannot run: limits is a list of
    (ok, what) pairs, checked when the call runs on a GPU. The GPU handlers check the same
    things, but an error a handler returns while XLA captures it into a command buffer crashes
    the process (jax 0.11.2: a segfault), so nothing they would refuse may reach them."""
    if gpu_platform(args):
        refuse_unmet(target, limits)


def refuse_unmet(target: str, limits, lead: str = "the GPU kernel cannot run this call:") -> None:
    """Raises a ValueError naming every unmet limit of (ok, what) pairs, after `lead`."""
    why = [what for ok, what in limits if not ok]
    if why:
        raise ValueError(f"{target}: {lead} " + "; ".join(why))


def check_runnable(target: str, args) -> None:
    """Raises a clear error before lowering when the op cannot run.

    Only concrete arrays are inspected; inside jit the registered stub handler
    reports a missing GPU library at run time.
    """
    load()
    if not _libs:
        raise RuntimeError(f"{target}: {BUILD_HINT['cpu']} [{_errors.get('cpu', '')}]")
    try:  # the handlers refuse these too, but a GPU one inside a command buffer would crash
        knobs.check_all()
    except knobs.KnobError as e:
        raise knobs.KnobError(f"{target}: {e}") from None
    plats = _array_platforms(args)
    if not plats:
        if any(isinstance(a, jax.core.Tracer) for a in args):
            return
        try:
            plats = {_xla_platform(jax.devices()[0])}
        except Exception:  # noqa: BLE001
            return
    for p in plats:
        if p not in LIBRARIES:
            raise RuntimeError(f"{target}: platform {p!r} is not supported by baro_jax "
                               f"(supported: cpu, CUDA, ROCM)")
        if target not in _registered.get(p, set()):
            if p != "cpu" and target in NO_GPU_KERNEL and p in _libs:
                raise RuntimeError(f"{target}: cannot run on {p}: {NO_GPU_KERNEL[target]}")
            why = _errors.get(p, "")
            raise RuntimeError(f"{target}: cannot run on {p}: {BUILD_HINT[p]}"
                               + (f" [{why.strip()}]" if why else ""))


# ---- the _small twins (docs/FFI.md "Handlers, scratch, limits") ----
SMALL_ROWS = 16  # calls of <= 16 rows (decode) take their GPU scratch as a result


def small_call(m: int, rows: int = SMALL_ROWS) -> bool:
    """m rows go through the op's _small twin: its GPU handler allocates nothing, so it may run
    inside XLA's command buffers (a decode step's graph). `rows`: the most rows the op sends
    there (the MoE's is BARO_MOE_SMALL_ROWS). BARO_CMDBUF_OPS=0 keeps every call on the ops that
    take scratch from XLA's allocator."""
    return m <= rows and knobs.knob("BARO_CMDBUF_OPS")


def round256(n: int) -> int:
    """n bytes rounded up as the GPU scratch layouts round each piece."""
    return (n + 255) // 256 * 256


def ffi_call_small(target: str, results, scratch_bytes: int, args, aliases=None, **attrs) -> tuple:
    """ffi_call of a _small twin: `results` plus its last u8 [scratch_bytes] scratch result,
    which is dropped from what comes back."""
    scratch = jax.ShapeDtypeStruct((scratch_bytes,), np.uint8)
    out = jax.ffi.ffi_call(target, tuple(results) + (scratch,), input_output_aliases=aliases or {})(*args, **attrs)
    return tuple(out[:-1])
