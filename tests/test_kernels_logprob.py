"""baro_log_softmax: m rows in one call are the bytes of one call per row (and of other row
splits), for row lengths from 1 to the model's vocabulary, with -inf entries and large
magnitudes; an all -inf row is NaN; the values are close to jax.nn.log_softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from baro_jax import ops_ordered, ops_xla
from custom_calls.testing import assert_same_bits, put
from kernel_util import platform, poison, splits_for


J_LSM = jax.jit(cc.log_softmax)
VOCAB = 248320  # Qwen3.5's

# V = 4099 cuts into eight uneven pieces on sm_90 (513 entries, the last 508); V = 1 and 31 leave
# pieces empty.
CASES = ([(m, V) for m in (1, 2, 7, 33) for V in (1, 31, 1000)] + [(1, 4099), (3, 4099)]
         + [(1, VOCAB), (2, VOCAB), (7, VOCAB)])


def logits(rng, m, V):
    """Random logits at several scales per row (1, 30, 1e4), some -inf entries, and rows with
    entries near the fp32 limit, so the max subtraction and the sum both matter."""
    scale = rng.choice([1.0, 30.0, 1e4], size=(m, 1))
    x = (rng.standard_normal((m, V)) * scale).astype(np.float32)
    if V > 1:
        x[rng.random((m, V)) < 0.05] = -np.inf
        x[np.arange(m), rng.integers(0, V, m)] = (rng.standard_normal(m) * scale[:, 0]).astype(np.float32)
    if m > 2:
        x[1] = (rng.standard_normal(V) * 1e37).astype(np.float32)  # near the fp32 range
    return x


def run(dev, x):
    poison(dev, x.shape)
    return np.asarray(J_LSM(put(dev, x)))


@pytest.mark.parametrize("m,V", CASES)
def test_rows_equal_one_row_calls(platform, m, V):
    rng = np.random.default_rng(m * 1000 + V % 997)
    x = logits(rng, m, V)
    y = run(platform, x)
    assert y.shape == (m, V) and y.dtype == np.float32
    for r in range(m):
        assert_same_bits(y[r:r + 1], run(platform, x[r:r + 1]), f"log_softmax row {r} vs its one-row call, V={V}")
    for name, chunks in splits_for(m, rng).items():
        if name == "rows":
            continue
        r0, parts = 0, []
        for c in chunks:
            parts.append(run(platform, x[r0:r0 + c]))
            r0 += c
        assert_same_bits(np.concatenate(parts), y, f"log_softmax, split {name}, m={m}, V={V}")

    # values: close to jax.nn.log_softmax (fp32, on the CPU); -inf stays -inf
    ref = np.asarray(jax.nn.log_softmax(jax.device_put(x, jax.devices("cpu")[0]), axis=-1)).astype(np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isneginf(y), np.isneginf(ref)), "-inf entries must stay -inf, and only they"
    assert not np.any(np.isnan(y)), "no NaN in rows with a finite max"
    # |error| <= a few ulp of the row's max |x - max| (the subtraction) plus the log's
    tol = 4e-6 * (np.max(np.abs(np.where(fin, ref, 0.0)), axis=-1, keepdims=True) + 1.0)
    err = np.abs(np.where(fin, y, 0.0) - np.where(fin, ref, 0.0))
    assert np.all(err <= tol), f"log_softmax vs jax.nn.log_softmax: max error {err.max():.3g}"
    # probabilities of each row sum to 1
    s = np.sum(np.exp(y.astype(np.float64)), axis=-1)
    assert np.allclose(s, 1.0, rtol=1e-4), f"exp(log_softmax) sums {s}"


def test_all_neg_inf_row_is_nan(platform):
    rng = np.random.default_rng(3)
    x = logits(rng, 5, 31)
    x[2] = -np.inf
    y = run(platform, x)
    assert np.all(np.isnan(y[2])), "an all -inf row gives NaN (docstring)"
    assert not np.any(np.isnan(np.delete(y, 2, axis=0))), "other rows are unaffected"
    assert_same_bits(y[2:3], run(platform, x[2:3]), "all -inf row vs its one-row call")


def test_backends(platform):
    rng = np.random.default_rng(4)
    x = logits(rng, 6, 1000)
    y = run(platform, x)
    xd = put(platform, x)
    assert_same_bits(np.asarray(jax.jit(ops_ordered.log_softmax)(xd)), y, "ops_ordered.log_softmax")
    yx = np.asarray(jax.jit(ops_xla.log_softmax)(xd))
    fin = np.isfinite(y)
    assert np.array_equal(fin, np.isfinite(yx)), "ops_xla.log_softmax: the same -inf entries"
    assert np.allclose(yx[fin], y[fin], rtol=1e-5, atol=1e-5 * np.abs(y[fin]).max()), "ops_xla.log_softmax values"


def test_refuses_bad_inputs():
    x = np.zeros((3, 5), np.float32)
    with pytest.raises(ValueError, match="logits must have rank 2"):
        cc.log_softmax(x[0])
    with pytest.raises(ValueError, match="m, V >= 1"):
        cc.log_softmax(x[:0])
    with pytest.raises(ValueError, match="m, V >= 1"):
        cc.log_softmax(x[:, :0])
    with pytest.raises(ValueError, match="logits must have dtype float32"):
        cc.log_softmax(x.astype(jnp.bfloat16))
