"""Model-level agreement of the two backends, and of both with transformers' float32.

Bounds (bf16 model, stated before measuring and kept):
- ordered vs xla (same rounding points, different summation order):
  mean |diff| <= 0.005 * std(ref logits), max |diff| <= 0.05 * max|ref|.
- each bf16 backend vs transformers float32: mean |diff| <= 0.05 * std(ref) and the
  argmax agrees on >= 90% of positions (a bf16 model can flip a near-tied expert
  choice, so the max is not bounded; the mean and top-1 rate are).
Measured at the time of writing (seed 3, 100 tokens): mean 0.006 vs std 4.0, max 0.13
between backends; mean 0.089, top-1 96-97% against float32.
- trained `tiny` (sharper logits, so absolute diffs are larger): teacher-forced argmax
  agreement of ordered vs xla on real Python source >= 99% (docs/DESIGN.md §1's bar for
  order-changing variants).
"""
import numpy as np
import pytest
import torch

import hf_util

import baro_jax


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    model = hf_util.build("qwen3_5_moe_text", seed=3)
    d = str(tmp_path_factory.mktemp("q35"))
    hf_util.save(model, d)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 256, 100)]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().numpy()
    got = {be: baro_jax.load(d, backend=be, progress=False).prompt_logits(ids) for be in ("xla", "ordered")}
    return ref, got


def test_ordered_vs_xla(hf_case):
    ref, got = hf_case
    d = np.abs(got["ordered"] - got["xla"])
    assert d.mean() <= 0.005 * ref.std(), d.mean()
    assert d.max() <= 0.05 * np.abs(ref).max(), d.max()


@pytest.mark.parametrize("backend", ["xla", "ordered"])
def test_bf16_vs_transformers_float32(hf_case, backend):
    ref, got = hf_case
    d = np.abs(got[backend] - ref)
    assert d.mean() <= 0.05 * ref.std(), d.mean()
    assert (got[backend].argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_tiny_random_ordered_vs_xla():
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 256, 80)]
    a = baro_jax.load("tiny-random", backend="ordered").prompt_logits(ids)
    b = baro_jax.load("tiny-random", backend="xla").prompt_logits(ids)
    d = np.abs(a - b)
    assert d.mean() <= 0.005 * b.std() and d.max() <= 0.05 * np.abs(b).max(), (d.mean(), d.max(), b.std())


def test_trained_tiny_ordered_vs_xla_argmax():
    """On the trained model, teacher-forced argmax agreement of the two backends on real Python
    source, against docs/DESIGN.md §1's bar for order-changing variants: >= 99% of positions."""
    import inspect

    ids = list(inspect.getsource(baro_jax.engine).encode()[:1500])
    a = baro_jax.load("tiny", backend="ordered", progress=False).prompt_logits(ids)
    b = baro_jax.load("tiny", backend="xla", progress=False).prompt_logits(ids)
    agree = (a.argmax(-1) == b.argmax(-1)).mean()
    assert agree >= 0.99, agree
