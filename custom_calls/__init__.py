"""baro_jax ordered kernels as JAX functions (XLA FFI custom calls).

Each op validates shapes and dtypes before lowering and works under jax.jit.
The op contract is docs/NUMERICS.md; the FFI signatures are in docs/FFI.md.
"""

from . import _lib
from ._lib import available_platforms, library_paths, load, load_errors
from .attention import attention
from .attention_rows import attention_rows
from .deltanet import conv, delta, delta_blocked
from .fetch import FetchRing
from .logprob import log_softmax
from .matmul import matmul, packed_columns
from .moe import HostStore, host_store, moe, moe_combine, moe_host, moe_pairs, moe_route, moe_slots
from .norm import add_rmsnorm, gated_norm, rmsnorm
from .scratch import scratch_bytes
from .topk import topk_rows



def gpu_platform(*arrays) -> str | None:
    """The GPU platform ("CUDA" or "ROCM") a call on these arrays runs on (on the default device
    where none is given, or inside jit), None for the CPU."""
    return _lib.gpu_platform(arrays)


load()
if "cpu" not in available_platforms():
    if "cpu" in _lib.broken_libraries():  # there, but not loadable: say which file and why, never "not built"
        _path, _why = _lib.broken_libraries()["cpu"]
        raise _lib.LibraryLoadError(f"custom_calls: the CPU library {_path} is there but could not be loaded: {_why} "
                                    "(rebuild it, see BUILD.md, or remove the file)", _path, _why, broken=True)
    raise _lib.LibraryLoadError("custom_calls: " + _lib.BUILD_HINT["cpu"] + " [" + load_errors().get("cpu", "") + "]")

__all__ = [
    "available_platforms", "library_paths", "load_errors",
    "matmul", "packed_columns", "rmsnorm", "add_rmsnorm", "gated_norm", "attention", "conv", "delta",
    "delta_blocked", "moe",
    "moe_slots", "moe_route", "moe_pairs", "moe_combine", "moe_host", "host_store", "HostStore", "FetchRing",
    "scratch_bytes", "gpu_platform", "attention_rows", "log_softmax", "topk_rows",
]
