"""Bad input through the Python API (issue 13): refused in Python, before dispatch, in our words.

The token, position and state checks live in the engine's entry points, so they hold for both
backends; the cases that never dispatch run on both, the donation case (one real decode step)
on xla only.
"""
import numpy as np
import pytest

import baro_jax
from baro_jax import model as M


@pytest.fixture(scope="module", params=["xla", "ordered"])
def eng(request):
    from baro_jax.engine import default_backend

    if request.param == "ordered" and default_backend() != "ordered":
        pytest.skip("the ordered backend is not built")
    return baro_jax.load("tiny", backend=request.param, progress=False)


@pytest.mark.parametrize("token,exc,msg", [
    (256, ValueError, "decode_step: token 256 is outside the vocabulary [0, 256)"),
    (100000, ValueError, "token 100000 is outside the vocabulary"),
    (-1, ValueError, "token -1 is outside the vocabulary"),
    (3.0, TypeError, "decode_step: token must be an integer, got float 3.0"),
    (None, TypeError, "token must be an integer, got NoneType"),
    (True, TypeError, "token must be an integer, got bool"),
])
def test_decode_step_token_checked(eng, token, exc, msg):
    with pytest.raises(exc) as ei:
        eng.decode_step(token, eng.new_state(64), 0)
    assert msg in str(ei.value)


@pytest.mark.parametrize("pos,exc,msg", [
    (-1, ValueError, "decode_step: pos must be >= 0, got -1"),
    (64, ValueError, "decode_step: position 64 does not fit the state's KV cache of 64 positions"),
    (1000, ValueError, "position 1000 does not fit the state's KV cache of 64"),
    (5.0, TypeError, "decode_step: pos must be an integer, got float 5.0"),
    ("3", TypeError, "pos must be an integer, got str"),
])
def test_decode_step_pos_checked(eng, pos, exc, msg):
    with pytest.raises(exc) as ei:
        eng.decode_step(1, eng.new_state(64), pos)
    assert msg in str(ei.value)


def test_pos_past_max_context_refused_even_when_the_state_is_longer(eng):
    big = M.init_state(eng.cfg, eng.dtype, 2 * eng.cfg.max_context)  # rope rows stop at max_context
    with pytest.raises(ValueError, match="position 8192 is past the model's context of 8192"):
        eng.decode_step(1, big, eng.cfg.max_context)
    with pytest.raises(ValueError, match="length 16384 is more than this engine's max_context of 8192"):
        eng.new_state(2 * eng.cfg.max_context)


def test_prefill_chunk_and_prefill_checks(eng):
    st = eng.new_state(64)
    with pytest.raises(ValueError, match=r"prefill_chunk: positions 60\.\.67 does not fit the state's KV cache of 64"):
        eng.prefill_chunk(list(range(8)), st, 60, 8)
    with pytest.raises(ValueError, match=r"prefill_chunk: 9 ids for a chunk of 8 rows"):
        eng.prefill_chunk(list(range(9)), st, 0, 8)
    with pytest.raises(ValueError, match="prefill_chunk: pos must be >= 0"):
        eng.prefill_chunk([1, 2], st, -3, 8)
    with pytest.raises(ValueError, match=r"prefill: positions 0\.\.99 does not fit the state's KV cache of 64"):
        eng.prefill(list(range(100)), state=st)  # a prompt longer than the state
    with pytest.raises(ValueError, match=r"chunk \(--chunk\) must be >= 1, got 0"):
        eng.prefill([1, 2, 3], chunk=0)
    with pytest.raises(TypeError, match=r"chunk \(--chunk\) must be an integer, got float 2\.5"):
        eng.prefill([1, 2, 3], chunk=2.5)
    with pytest.raises(TypeError, match=r"token ids\[1\] must be an integer, got float 2\.5 .*not truncated"):
        eng.prefill([1, 2.5, 3])
    with pytest.raises(TypeError, match="token ids must be integers, got an array of float32"):
        eng.prefill(np.array([1.0, 2.0], np.float32))
    with pytest.raises(ValueError, match=r"token id\(s\) \[300\] outside the vocabulary"):
        eng.prefill([1, 300])


def test_state_from_another_model(eng):
    other = baro_jax.load("tiny-random", backend="xla", progress=False)
    with pytest.raises(ValueError, match="this state belongs to a model with 4 layers, this model has 8"):
        eng.decode_step(1, other.new_state(64), 0)
    st = list(eng.new_state(64))
    st[0] = {"conv": np.zeros((3, 12), np.float32), "ssm": st[0]["ssm"]}
    with pytest.raises(ValueError, match=r"does not belong to this model: layer 0 'conv' is \[3, 12\] float32, "
                                         rf"this model needs \[3, {eng.cfg.conv_dim}\] bfloat16"):
        eng.decode_step(1, tuple(st), 0)
    with pytest.raises(TypeError, match="state must be the tuple of per-layer dicts"):
        eng.decode_step(1, None, 0)


def test_donated_state_reuse_is_named():
    eng = baro_jax.load("tiny", backend="xla", progress=False)
    st = eng.new_state(64)
    _, st2 = eng.decode_step(1, st, 0)
    with pytest.raises(ValueError, match="the state was already consumed: decode_step and prefill donate the state"):
        eng.decode_step(2, st, 1)
    pre = eng.prefill([1, 2, 3], chunk=4, state=st2)
    with pytest.raises(ValueError, match="already consumed"):
        eng.prefill([1, 2, 3], state=st2)
    logits, _ = eng.decode_step(4, pre.state, 3)  # the returned state is the live one
    assert np.isfinite(np.asarray(logits)).all()


def test_generate_and_load_argument_types(eng):
    with pytest.raises(TypeError, match="prompt must be a str or a sequence of token ids, got NoneType"):
        eng.generate(None)
    with pytest.raises(TypeError, match=r"max_new_tokens \(--max-new-tokens\) must be an integer, got float"):
        eng.generate([1, 2], max_new_tokens=2.0)
    with pytest.raises(TypeError, match="sampling must be a baro_jax.Sampling, got dict"):
        eng.generate([1, 2], 2, sampling={"temperature": 1.0})
    for t in (float("nan"), float("inf"), -0.5):
        with pytest.raises(ValueError, match="temperature must be"):
            eng.generate([1, 2], 2, sampling=baro_jax.Sampling(temperature=t))
    with pytest.raises(ValueError, match="top_p must be a finite number"):
        eng.generate([1, 2], 2, sampling=baro_jax.Sampling(temperature=1.0, top_p=float("nan")))
    with pytest.raises(ValueError, match=r"top_k \(--top-k\) 1000 is larger than the vocabulary of 256"):
        eng.generate([1, 2], 2, sampling=baro_jax.Sampling(temperature=1.0, top_k=1000))
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63 - 1\]"):
        eng.generate([1, 2], 2, sampling=baro_jax.Sampling(seed=2**64))
    with pytest.raises(TypeError, match="model must be a checkpoint directory or a preset name"):
        baro_jax.load(None)
    with pytest.raises(TypeError, match=r"device_budget_gb \(--device-budget-gb\) must be a number, got str"):
        baro_jax.load("tiny", device_budget_gb="8")
    for b in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="device_budget_gb .* must be a finite number"):
            baro_jax.load("tiny", device_budget_gb=b)
    with pytest.raises(ValueError, match=r"device_budget_gb .* must be a finite number > 0, got 0"):
        baro_jax.load("tiny", device_budget_gb=0)
    with pytest.raises(TypeError, match=r"max_context \(--max-context\) must be an integer, got float"):
        baro_jax.load("tiny", max_context=100.0)
    with pytest.raises(ValueError, match=r"max_context \(--max-context\) must be >= 1, got 0"):
        baro_jax.load("tiny", max_context=0)
    with pytest.raises(baro_jax.ConfigError, match="beyond the model's context of 131072"):
        baro_jax.load("qwen3.5-35b-a3b", max_context=10**9)
