"""Shape/dtype validation shared by the custom_calls wrappers (runs before lowering)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BF16 = jnp.bfloat16
F32 = jnp.float32


def _shape_str(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def array(op: str, name: str, x, shape, dtype, *, dtype_note: str = ""):
    """Checks rank, sizes (None = any) and dtype of x; returns x unchanged.

    Raises ValueError "op: name must have shape [...] (dtype), got shape (...) dtype ...".
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    got_shape = tuple(x.shape)
    ok_shape = len(got_shape) == len(shape) and all(
        e is None or e == g for e, g in zip(shape, got_shape))
    if not ok_shape:
        raise ValueError(f"{op}: {name} must have shape {_shape_str(shape)}, "
                         f"got shape {list(got_shape)} (dtype {np.dtype(x.dtype).name})")
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise ValueError(f"{op}: {name} must have dtype {np.dtype(dtype).name}"
                         f"{dtype_note}, got dtype {np.dtype(x.dtype).name} "
                         f"(shape {list(got_shape)})")
    return x


def rank(op: str, name: str, x, r: int):
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    if len(x.shape) != r:
        raise ValueError(f"{op}: {name} must have rank {r}, got shape {list(x.shape)}")
    return x


INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
_FITS_INT32 = tuple(np.dtype(t) for t in (np.int8, np.int16, np.uint8, np.uint16))


def _fits_int32(op: str, name: str, v: int) -> int:
    if not INT32_MIN <= v <= INT32_MAX:
        raise ValueError(f"{op}: {name}={v} does not fit in int32 (the kernels take int32 positions and counts)")
    return v


def int_scalar(op: str, name: str, v):
    """An int32 scalar array (traced values welcome). A Python or numpy integer, or a concrete
    array of a wider integer type, is converted when its value fits in int32 and refused when it
    does not (a silent wrap would move the position); a traced value of a type that could hold
    more than int32 (int64, uint32, uint64) is refused, since its value is unknown here."""
    if isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{op}: {name} must be an int32 scalar, got a bool")
    if isinstance(v, (int, np.integer)):
        return jnp.asarray(_fits_int32(op, name, int(v)), dtype=jnp.int32)
    if not hasattr(v, "shape") or not hasattr(v, "dtype"):
        raise ValueError(f"{op}: {name} must be an int32 scalar array, got {type(v).__name__}")
    if tuple(v.shape) != ():
        raise ValueError(f"{op}: {name} must be a scalar (shape []), got shape {list(v.shape)}")
    if not jnp.issubdtype(v.dtype, jnp.integer):
        raise ValueError(f"{op}: {name} must be an int32 scalar, got dtype {np.dtype(v.dtype).name}")
    dt = np.dtype(v.dtype)
    if dt == np.int32:
        return v
    if dt in _FITS_INT32:
        return jnp.asarray(v).astype(jnp.int32)
    if isinstance(v, jax.core.Tracer) or not isinstance(v, (np.ndarray, jax.Array)):
        raise ValueError(f"{op}: {name} must be an int32 scalar, got a traced {dt.name} (its value could be past "
                         "int32; convert it where its range is known)")
    _fits_int32(op, name, int(np.asarray(v)))
    return jnp.asarray(v).astype(jnp.int32)


def positive_int(op: str, name: str, v) -> int:
    try:
        iv = int(v)
    except TypeError:
        raise ValueError(f"{op}: {name} must be a Python int (static), got {type(v).__name__}") from None
    if iv != v or iv < 1:
        raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")
    return iv


def column(op: str, name: str, v) -> np.int64:
    """A static column offset: a Python int >= 0."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{op}: {name} must be a static Python int >= 0, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{op}: {name} must be >= 0, got {v}")
    return np.int64(v)


def columns(op: str, name: str, x, m: int, col, width: int, col_name: str, width_name: str, dtype):
    """x [m, W] of dtype with columns col .. col + width inside it (an operand read in place
    from a wider array, e.g. the GDN projection); returns x."""
    rank(op, name, x, 2)
    if x.shape[0] != m or col + width > x.shape[1]:
        raise ValueError(f"{op}: {name} must have shape [{m}, W] with {col_name} + {width_name} <= W "
                         f"({col_name}={int(col)}, {width_name}={width}), got shape {list(x.shape)}")
    return array(op, name, x, tuple(x.shape), dtype)


def f32_attr(op: str, name: str, v) -> np.float32:
    """A norm's eps: a static real number, finite in float32 and >= 0 (the handlers refuse the
    rest too)."""
    if isinstance(v, jax.core.Tracer):
        raise ValueError(f"{op}: {name} must be a static Python float, got a traced value")
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{op}: {name} must be a real number, got {type(v).__name__} {v!r:.60}")
    with np.errstate(over="ignore"):
        f = np.float32(v)
    if not np.isfinite(f) or f < 0:
        raise ValueError(f"{op}: {name} must be a finite number >= 0 (in float32), got {v!r}")
    return f


BF16_NOTE = " (the ordered kernels take bfloat16 activations and weights only)"


def concrete_int(v):
    """v's value when it is known here without waiting on a device (a Python or numpy integer, a
    one-element numpy array or CPU jax array), else None (traced, or on a GPU)."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, jax.core.Tracer) or not isinstance(v, (np.ndarray, jax.Array)) or \
            not jnp.issubdtype(v.dtype, jnp.integer):
        return None  # traced, or a shape only (ShapeDtypeStruct)
    if isinstance(v, jax.Array):
        try:
            if any(d.platform != "cpu" for d in v.devices()):
                return None
        except Exception:  # noqa: BLE001 - a deleted array: XLA reports it
            return None
    try:
        a = np.asarray(v)
    except Exception:  # noqa: BLE001 - a deleted array: XLA reports it
        return None
    return int(a.reshape(-1)[0]) if a.size == 1 else None
