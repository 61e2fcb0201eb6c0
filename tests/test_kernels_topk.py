"""baro_topk_rows: each row's k largest logits and ids equal, byte for byte, a numpy reference of
the IEEE total order with ties to the lower id and jax.lax.top_k on the CPU, for rows of 1 to the
model's vocabulary and k from 1 to 256, with ties at the k-th place, +-0, infinities and NaNs; m
rows at once give the bytes of one call per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import assert_same_bits, put
from kernel_util import platform, poison


VOCAB = 248320  # Qwen3.5's
CASES = ([(m, V, k) for m in (1, 2, 7) for V, k in ((1, 1), (5, 3), (1000, 64), (4099, 20), (4099, 256))]
         + [(33, 1000, 1), (3, 300, 300), (1, VOCAB, 64), (2, VOCAB, 20), (7, VOCAB, 64)])


def logits(rng, m, V, k):
    """Logits at several scales, with the k-th largest of some rows repeated elsewhere (ties the
    selection must break by id, some beyond the k places), +-0 pairs, infinities and NaNs."""
    scale = rng.choice([1.0, 30.0, 1e4], size=(m, 1))
    x = (rng.standard_normal((m, V)) * scale).astype(np.float32)
    for r in range(m):
        if V >= 8 and r % 2 == 0:  # ties across the k boundary
            kth = np.sort(x[r])[::-1][min(k, V) - 1]
            x[r, rng.choice(V, size=min(4, V // 2), replace=False)] = kth
        if V >= 16 and r % 3 == 1:
            x[r, rng.choice(V, size=6, replace=False)] = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan]
        if V >= 16 and r % 3 == 2:
            x[r, rng.choice(V, size=V // 8, replace=False)] = -np.inf  # masked ids
    return x


def reference(x, k):
    """numpy: the total order of the float bits (negatives below the positives, reversed), ties
    to the lower id, the k largest first."""
    b = x.view(np.uint32)
    key = np.where(b >> 31, ~b, b | np.uint32(0x80000000)).astype(np.uint64)
    ids = np.stack([np.lexsort((np.arange(x.shape[1]), -key[r].astype(np.int64)))[:k] for r in range(x.shape[0])])
    return np.take_along_axis(x, ids, axis=1), ids.astype(np.int32)


J_TOPK = jax.jit(cc.topk_rows, static_argnames=("k",))


def run(dev, x, k):
    poison(dev, (x.shape[0], k))
    poison(dev, (x.shape[0], k), jnp.int32)
    v, i = J_TOPK(put(dev, x), k=k)
    return np.asarray(v), np.asarray(i)


@pytest.mark.parametrize("m,V,k", CASES)
def test_topk_rows_is_the_total_order(platform, m, V, k):
    if platform.platform != "cpu" and k > cc.topk.MAX_K_GPU:
        pytest.skip(f"k={k}: the GPU kernel takes k <= {cc.topk.MAX_K_GPU} (its refusal: test_gpu_k_limit)")
    rng = np.random.default_rng(m * 7919 + V + k)
    x = logits(rng, m, V, k)
    vals, ids = run(platform, x, k)
    assert vals.shape == (m, k) and ids.shape == (m, k) and ids.dtype == np.int32
    want_v, want_i = reference(x, k)
    assert_same_bits(ids, want_i, f"topk_rows ids, m={m} V={V} k={k}")
    assert_same_bits(vals, want_v, f"topk_rows values, m={m} V={V} k={k}")
    # jax.lax.top_k on the CPU: the same bytes (sampling's device draw may use either)
    lv, li = jax.lax.top_k(jax.device_put(x, jax.devices("cpu")[0]), k)
    assert_same_bits(ids, np.asarray(li), f"topk_rows vs lax.top_k ids, m={m} V={V} k={k}")
    assert_same_bits(vals, np.asarray(lv), f"topk_rows vs lax.top_k values, m={m} V={V} k={k}")
    for r in sorted({0, m - 1}):
        v1, i1 = run(platform, x[r:r + 1], k)
        assert_same_bits(i1[0], ids[r], f"topk_rows row {r} vs its one-row call")
        assert_same_bits(v1[0], vals[r], f"topk_rows row {r} values vs its one-row call")
    if m > 2:  # the rows in two uneven calls
        cut = int(rng.integers(1, m))
        parts = [run(platform, x[a:b], k) for a, b in ((0, cut), (cut, m))]
        assert_same_bits(np.concatenate([p[1] for p in parts]), ids, f"topk_rows split at {cut} of {m}")


def test_all_equal_row_takes_the_lowest_ids(platform):
    x = np.full((2, 3000), 1.5, np.float32)
    x[1, 2000:] = 2.0  # 1000 equal maxima: the first 64 of them
    vals, ids = run(platform, x, 64)
    assert_same_bits(ids[0], np.arange(64, dtype=np.int32), "all-equal row: ids 0..63")
    assert_same_bits(ids[1], np.arange(2000, 2064, dtype=np.int32), "1000 equal maxima: the lowest 64 ids")
    assert np.all(vals[1] == 2.0)


def test_refuses_bad_inputs():
    x = np.zeros((3, 5), np.float32)
    with pytest.raises(ValueError, match="logits must have rank 2"):
        cc.topk_rows(x[0], 1)
    with pytest.raises(ValueError, match="m, V >= 1"):
        cc.topk_rows(x[:0], 1)
    with pytest.raises(ValueError, match="logits must have dtype float32"):
        cc.topk_rows(x.astype(jnp.bfloat16), 1)
    for k in (0, 6, -1):
        with pytest.raises(ValueError, match=r"k must be in \[1, V=5\]"):
            cc.topk_rows(x, k)
    for k in (True, 2.0, "2", None):
        with pytest.raises(TypeError, match="k must be an int"):
            cc.topk_rows(x, k)


def test_gpu_k_limit(platform):
    x = np.random.default_rng(5).standard_normal((2, 600)).astype(np.float32)
    if platform.platform == "gpu":
        with pytest.raises(ValueError, match="k <= 256"):
            cc.topk_rows(put(platform, x), 257)
    else:  # the CPU takes any k <= V
        vals, ids = run(platform, x, 600)
        assert_same_bits(ids, reference(x, 600)[1], "topk_rows k = V on the CPU")
