"""Backend switchboard: "ordered" -> the row-invariant custom calls, "xla" -> plain jnp."""
from __future__ import annotations

BACKENDS = ("ordered", "xla")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here. broken: the kernel library is there but does not load
    (an error to report, never a reason to fall back to xla); otherwise it was not built."""

    def __init__(self, msg: str, broken: bool = False, path: str | None = None):
        super().__init__(msg)
        self.broken, self.path = broken, path


def _ordered_module():
    """ops_ordered, or (None, BackendUnavailable) saying why it cannot be had."""
    try:
        from . import ops_ordered
    except ImportError as e:  # custom_calls missing, its library not built, or there but broken
        if getattr(e, "broken", False):
            return None, BackendUnavailable(
                f"the 'ordered' backend's kernel library {e.path} is there but could not be loaded: {e.error}; "
                "rebuild it (`pip install --no-build-isolation --no-deps -e .`, see BUILD.md) or remove the file",
                broken=True, path=e.path)
        return None, BackendUnavailable(
            f"the 'ordered' backend needs the compiled custom_calls library ({e}); "
            "install the package with `pip install .` (see BUILD.md) or use --backend xla")
    return ops_ordered, None


def ordered_status() -> tuple[bool, str, bool]:
    """(available, reason, broken) of the ordered backend: reason is "" when available; broken
    says the library is there but does not load (not a reason to fall back to xla)."""
    mod, err = _ordered_module()
    return (True, "", False) if mod is not None else (False, str(err), err.broken)


def get_ops(backend: str):
    if backend == "xla":
        from . import ops_xla
        return ops_xla
    if backend == "ordered":
        mod, err = _ordered_module()
        if mod is None:
            raise err
        return mod
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def kernel_scratch_bytes(op: str, **dims) -> int | None:
    """The GPU scratch bytes one call of a kernel takes (custom_calls.scratch_bytes: the kernel
    library's own layout), or None where the library is not built."""
    try:
        from custom_calls import scratch_bytes
    except ImportError:
        return None
    return scratch_bytes(op, **dims)
