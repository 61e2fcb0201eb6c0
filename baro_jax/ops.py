"""Backend switchboard: "ordered" -> the row-invariant custom calls, "xla" -> plain jnp."""
from __future__ import annotations

BACKENDS = ("ordered", "xla")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (e.g. the kernel library was not built)."""


def get_ops(backend: str):
    if backend == "xla":
        from . import ops_xla
        return ops_xla
    if backend == "ordered":
        try:
            from . import ops_ordered
        except ImportError as e:  # custom_calls missing or its library not built
            raise BackendUnavailable(
                f"the 'ordered' backend needs the compiled custom_calls library ({e}); "
                "install the package with `pip install .` (see BUILD.md) or use --backend xla") from e
        return ops_ordered
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def kernel_scratch_bytes(op: str, **dims) -> int | None:
    """The GPU scratch bytes one call of a kernel takes (custom_calls.scratch_bytes: the kernel
    library's own layout), or None where the library is not built."""
    try:
        from custom_calls import scratch_bytes
    except ImportError:
        return None
    return scratch_bytes(op, **dims)
