"""Checkpoint loading: transformers saves, the official Qwen3.5 layout, the Qwen3-Next regroup,
error messages, dtypes, and the synthetic weights."""
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import hf_util
from baro_jax import config as C
from baro_jax import weights as W
from baro_jax.synthetic import synthetic_params

SMALL = dict(num_experts=4)  # keep the per-expert files short


def _leaves(params):
    return jax.tree_util.tree_leaves_with_path(params)


def _assert_tree_equal(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype, jax.tree_util.keystr(path)
        assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)


def _shapes_ok(params, cfg, dtype):
    want = W.param_shapes(cfg)
    flat_w = jax.tree_util.tree_leaves(want, is_leaf=lambda t: isinstance(t, tuple) and len(t) == 2
                                       and isinstance(t[1], bool))
    flat_p = jax.tree_util.tree_leaves(params)
    assert len(flat_w) == len(flat_p)
    for (shape, f32), x in zip(flat_w, flat_p):
        assert tuple(x.shape) == tuple(shape)
        assert x.dtype == (jnp.float32 if f32 else jnp.dtype(dtype))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One tiny model per class, saved by transformers (per-expert layout)."""
    out = {}
    for arch in ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"):
        m = hf_util.build(arch, seed=7, **SMALL)
        d = str(tmp_path_factory.mktemp(arch))
        hf_util.save(m, d)
        out[arch] = (m, d)
    return out


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"])
def test_transformers_save_loads(saved, arch):
    model, d = saved[arch]
    names = load_file(os.path.join(d, "model.safetensors")).keys()
    # what transformers 5.x save_pretrained writes: per-expert tensors, prefix by class
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)
    prefix = "model.language_model." if arch == "qwen3_5_moe" else "model."
    assert f"{prefix}embed_tokens.weight" in names
    cfg = C.load_config(d)
    p = W.load_params(d, cfg, dtype=jnp.float32, progress=False)
    _shapes_ok(p, cfg, jnp.float32)
    # the in-memory state dict has fused experts: same params
    _assert_tree_equal(p, W.params_from_state_dict(model.state_dict(), cfg, jnp.float32))
    # spot checks against the torch modules, written out by hand
    tm = model.model.language_model if arch == "qwen3_5_moe" else model.model
    t = lambda x: x.detach().numpy()
    L0, L3 = tm.layers[0], tm.layers[3]
    np.testing.assert_array_equal(p["embed"], t(tm.embed_tokens.weight))
    np.testing.assert_array_equal(p["lm_head"], t(model.lm_head.weight))
    np.testing.assert_array_equal(p["final_norm"], t(tm.norm.weight))
    np.testing.assert_array_equal(p["layers"][0]["moe"]["gate_up"], t(L0.mlp.experts.gate_up_proj))
    np.testing.assert_array_equal(p["layers"][0]["moe"]["down"], t(L0.mlp.experts.down_proj))
    np.testing.assert_array_equal(p["layers"][0]["moe"]["router"], t(L0.mlp.gate.weight))
    np.testing.assert_array_equal(p["layers"][0]["moe"]["shared_gate_up"],
                                  np.concatenate([t(L0.mlp.shared_expert.gate_proj.weight),
                                                  t(L0.mlp.shared_expert.up_proj.weight)]))
    np.testing.assert_array_equal(p["layers"][0]["gdn"]["conv"], t(L0.linear_attn.conv1d.weight)[:, 0, :])
    np.testing.assert_array_equal(p["layers"][0]["gdn"]["A_log"], t(L0.linear_attn.A_log))
    np.testing.assert_array_equal(p["layers"][3]["attn"]["qkv"],
                                  np.concatenate([t(L3.self_attn.q_proj.weight), t(L3.self_attn.k_proj.weight),
                                                  t(L3.self_attn.v_proj.weight)]))
    np.testing.assert_array_equal(p["layers"][3]["attn"]["q_norm"], t(L3.self_attn.q_norm.weight))
    if arch != "qwen3_next":
        la = L0.linear_attn
        np.testing.assert_array_equal(p["layers"][0]["gdn"]["in_proj"], np.concatenate(
            [t(la.in_proj_qkv.weight), t(la.in_proj_z.weight), t(la.in_proj_b.weight), t(la.in_proj_a.weight)]))
    assert "attn" not in p["layers"][0] and "gdn" not in p["layers"][3]


@pytest.mark.parametrize("arch,shards", [("qwen3_5_moe_text", 1), ("qwen3_5_moe", 3)])
def test_official_qwen35_layout_equals_per_expert_save(saved, tmp_path, arch, shards):
    """model.language_model. prefix, fused experts, mtp.* and model.visual.* junk, (sharded) ==
    transformers' per-expert save, bit for bit."""
    _, d = saved[arch]
    off = hf_util.write_official_qwen35(d, str(tmp_path / "official"), junk=True, shards=shards)
    names = set(hf_util.read_safetensors_dir(off))
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names if not n.startswith("mtp."))
    assert any(n.startswith("mtp.") for n in names) and any(n.startswith("model.visual.") for n in names)
    cfg_a, cfg_b = C.load_config(d), C.load_config(off)
    assert cfg_b.model_type == "qwen3_5_moe"
    for dt in (jnp.float32, jnp.bfloat16):
        _assert_tree_equal(W.load_params(d, cfg_a, dtype=dt, progress=False),
                           W.load_params(off, cfg_b, dtype=dt, progress=False))


def test_qwen3_next_regroup_matches_transformers(saved):
    """x @ in_proj^T, split flat, == transformers' fix_query_key_value_ordering of in_proj_qkvz/ba."""
    model, d = saved["qwen3_next"]
    cfg = C.load_config(d)
    p = W.load_params(d, cfg, dtype=jnp.float32, progress=False)
    la = model.model.layers[0].linear_attn
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(x), la.in_proj_ba(x))
    want = np.concatenate([t.reshape(5, -1).numpy() for t in (q, k, v, z, b, a)], axis=1)
    got = x[0].numpy().astype(np.float64) @ np.asarray(p["layers"][0]["gdn"]["in_proj"], np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_qwen3_next_regroup_hand_numbers():
    """Row r of in_proj_qkvz / in_proj_ba holds the value r: check the regrouped row order by hand."""
    cfg = C.Config(**dict(C.PRESETS["tiny-random"], model_type="qwen3_next", lin_k_heads=2, lin_v_heads=6,
                          lin_k_dim=3, lin_v_dim=2, num_layers=1, layer_types=("linear_attention",))).validate()
    nk, nv, dk, dv, r = 2, 6, 3, 2, 3
    D = cfg.hidden_size
    per_group = 2 * dk + 2 * r * dv
    qkvz = np.repeat(np.arange(nk * per_group, dtype=np.float32)[:, None], D, 1)
    ba = np.repeat(1000 + np.arange(2 * nv, dtype=np.float32)[:, None], D, 1)
    rows = W._regroup_qkvz(W._Dims.of(cfg)), W._regroup_ba(W._Dims.of(cfg))
    buf = np.full((cfg.gdn_in_dim, D), -1, np.float32)
    rows[0](buf, qkvz)
    rows[1](buf, ba)
    got = buf[:, 0].astype(int).tolist()
    want = []
    for g in range(nk):  # q heads
        want += [g * per_group + i for i in range(dk)]
    for g in range(nk):  # k heads
        want += [g * per_group + dk + i for i in range(dk)]
    for part in (0, 1):  # v then z: value head j = g*r + jj uses key head g
        for g in range(nk):
            want += [g * per_group + 2 * dk + part * r * dv + i for i in range(r * dv)]
    for part in (0, 1):  # b then a
        for g in range(nk):
            want += [1000 + g * 2 * r + part * r + i for i in range(r)]
    assert got == want


def test_dtypes_bf16(saved):
    model, d = saved["qwen3_5_moe_text"]
    cfg = C.load_config(d)
    p = W.load_params(d, cfg, dtype=jnp.bfloat16, progress=False)
    _shapes_ok(p, cfg, jnp.bfloat16)
    sd = model.state_dict()
    np.testing.assert_array_equal(np.asarray(p["embed"]),
                                  sd["model.embed_tokens.weight"].numpy().astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(np.asarray(p["layers"][0]["gdn"]["dt_bias"]),
                                  sd["model.layers.0.linear_attn.dt_bias"].numpy())  # stays f32
    # a bf16 checkpoint loads bit-exactly
    tb = hf_util.build("qwen3_5_moe_text", seed=3, **SMALL).to(torch.bfloat16)
    p2 = W.params_from_state_dict(tb.state_dict(), cfg, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(p2["layers"][1]["moe"]["gate_up"]).view(np.int16),
                                  tb.model.layers[1].mlp.experts.gate_up_proj.detach().view(torch.int16).numpy())


def test_tied_embeddings(tmp_path):
    m = hf_util.build("qwen3_next", seed=5, tie_word_embeddings=True, **SMALL)
    d = hf_util.save(m, str(tmp_path / "tied"))
    cfg = C.load_config(d)
    assert cfg.tie_word_embeddings
    p = W.load_params(d, cfg, dtype=jnp.float32, progress=False)
    assert p["lm_head"] is p["embed"]
    # an lm_head.weight present in a tied checkpoint is ignored
    t = load_file(os.path.join(d, "model.safetensors"))
    t["lm_head.weight"] = np.zeros_like(t["model.embed_tokens.weight"])
    p2 = W.params_from_state_dict(t, cfg, jnp.float32)
    np.testing.assert_array_equal(p2["lm_head"], p["embed"])


def _broken(d, tmp_path, edit):
    t = load_file(os.path.join(d, "model.safetensors"))
    edit(t)
    out = tmp_path / "broken"
    out.mkdir(exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(open(os.path.join(d, "config.json")).read())
    return str(out)


def test_missing_tensors_all_named(saved, tmp_path):
    _, d = saved["qwen3_next"]
    gone = ["model.layers.0.linear_attn.in_proj_ba.weight", "model.layers.3.self_attn.k_norm.weight",
            "model.layers.2.mlp.experts.3.up_proj.weight", "lm_head.weight"]
    b = _broken(d, tmp_path, lambda t: [t.pop(n) for n in gone])
    with pytest.raises(W.WeightsError) as ei:
        W.load_params(b, C.load_config(b), progress=False)
    msg = str(ei.value)
    assert "4 missing" in msg
    for n in gone:
        assert f"  {n}\n" in msg + "\n", n


def test_unknown_tensors_named(saved, tmp_path):
    _, d = saved["qwen3_5_moe_text"]

    def edit(t):
        t["model.layers.0.mlp.foo.weight"] = np.zeros((2, 2), np.float32)
        t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((2, 2), np.float32)  # layer 0 is linear attention
        t["model.layers.9.input_layernorm.weight"] = np.zeros((64,), np.float32)
        t["mtp.anything"] = np.zeros((1,), np.float32)  # ignored
    b = _broken(d, tmp_path, edit)
    with pytest.raises(W.WeightsError) as ei:
        W.load_params(b, C.load_config(b), progress=False)
    msg = str(ei.value)
    assert "3 unexpected" in msg and "0 missing" in msg
    assert "model.layers.0.mlp.foo.weight  (no rule matches it)" in msg
    assert "model.layers.0.self_attn.q_proj.weight  (layer 0 is linear_attention)" in msg
    assert "model.layers.9.input_layernorm.weight  (layer 9 >= num_hidden_layers 4)" in msg
    assert "mtp.anything" not in msg


def test_misshaped_tensor_named(saved, tmp_path):
    _, d = saved["qwen3_5_moe_text"]

    def edit(t):
        t["model.layers.1.linear_attn.in_proj_z.weight"] = t["model.layers.1.linear_attn.in_proj_z.weight"][:-1]
        t["model.layers.3.self_attn.o_proj.weight"] = t["model.layers.3.self_attn.o_proj.weight"].T.copy()
    b = _broken(d, tmp_path, edit)
    with pytest.raises(W.WeightsError) as ei:
        W.load_params(b, C.load_config(b), progress=False)
    msg = str(ei.value)
    assert "2 mis-shaped" in msg
    assert "model.layers.1.linear_attn.in_proj_z.weight: shape [63, 64], expected [64, 64]" in msg
    assert "model.layers.3.self_attn.o_proj.weight: shape [128, 64], expected [64, 128]" in msg


def test_quantized_dtype_rejected(saved, tmp_path):
    _, d = saved["qwen3_next"]

    def edit(t):
        t["model.layers.1.linear_attn.out_proj.weight"] = t["model.layers.1.linear_attn.out_proj.weight"].astype(np.int8)
    b = _broken(d, tmp_path, edit)
    with pytest.raises(W.WeightsError, match=r"model.layers.1.linear_attn.out_proj.weight: unsupported dtype I8"):
        W.load_params(b, C.load_config(b), progress=False)


def test_mixed_expert_layouts_rejected(saved, tmp_path):
    _, d = saved["qwen3_5_moe_text"]

    def edit(t):
        t["model.layers.2.mlp.experts.down_proj"] = np.zeros((4, 64, 32), np.float32)
    b = _broken(d, tmp_path, edit)
    with pytest.raises(W.WeightsError, match=r"missing tensor\(s\) \(1\):\n  model.layers.2.mlp.experts.gate_up_proj"):
        W.load_params(b, C.load_config(b), progress=False)


def test_no_checkpoint(tmp_path):
    with pytest.raises(W.WeightsError, match="no model.safetensors.index.json or model.safetensors"):
        W.load_params(str(tmp_path), C.preset("tiny-random"), progress=False)


def test_progress_lines(saved, capsys):
    _, d = saved["qwen3_next"]
    cfg = C.load_config(d)
    W.load_params(d, cfg, progress=False)
    assert capsys.readouterr().err == ""
    W.load_params(d, cfg, progress=True)
    err = capsys.readouterr().err
    assert "[baro_jax] shard 1/1 model.safetensors:" in err and "[baro_jax] loaded" in err


def test_load_dtype_spellings(saved):
    """bfloat16 / float32, by name or as a dtype; other spellings are refused, never converted
    (jnp.dtype would take "half" as float16 and None as float64)."""
    model, d = saved["qwen3_next"]
    cfg = C.load_config(d)
    for dt in ("bfloat16", jnp.bfloat16, np.dtype(ml_dtypes.bfloat16), "float32", jnp.float32, np.float32):
        p = W.load_params(d, cfg, dtype=dt, progress=False)
        assert p["embed"].dtype == jnp.dtype(dt)
    for dt in ("bf16", "f32", "float16", "half", np.float16, "float64", float, None, "BFLOAT16", 3):
        with pytest.raises(ValueError) as ei:
            W.load_params(d, cfg, dtype=dt, progress=False)
        assert str(ei.value) == f"dtype must be one of bfloat16, float32 (a name or a dtype), got {dt!r}"
        with pytest.raises(ValueError, match="dtype must be one of bfloat16, float32"):
            W.params_from_state_dict(model.state_dict(), cfg, dtype=dt)


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_tree_and_determinism():
    cfg = C.preset("tiny-random")
    a = synthetic_params(cfg, seed=0, dtype=jnp.bfloat16)
    _shapes_ok(a, cfg, jnp.bfloat16)
    _assert_tree_equal(a, synthetic_params(cfg, seed=0, dtype=jnp.bfloat16))
    c = synthetic_params(cfg, seed=1, dtype=jnp.bfloat16)
    assert not np.array_equal(np.asarray(a["embed"]), np.asarray(c["embed"]))
    g = a["layers"][0]["gdn"]
    assert np.all(np.exp(np.asarray(g["A_log"])) >= 1 - 1e-5) and np.all(np.exp(np.asarray(g["A_log"])) <= 16 + 1e-4)
    for x in jax.tree_util.tree_leaves(a):
        assert np.all(np.isfinite(np.asarray(x, np.float32)))


def test_synthetic_full_size_shapes():
    """The real presets' trees, by shape only (nothing allocated)."""
    for name in ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b"):
        cfg = C.preset(name)
        shapes = jax.eval_shape(lambda: synthetic_params(cfg, seed=0))
        _shapes_ok(shapes, cfg, jnp.bfloat16)
        n = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))
        assert n > 60e9 if name.startswith("qwen3.5") else n > 150e9


def test_synthetic_activations_stay_sane():
    """The tiny preset's synthetic weights give finite, spread-out logits through every layer."""
    import baro_jax

    eng = baro_jax.load("tiny", backend="xla", dtype="float32", progress=False)
    ids = list(range(3, 3 + 40))
    lg = eng.prompt_logits(ids)
    assert np.all(np.isfinite(lg))
    assert 1.0 < float(np.std(lg[-1])) < 50.0
    # deep stack: 12 layers of the same shapes stays finite too
    cfg = C.Config(**dict(C.PRESETS["tiny-random"], num_layers=12, layer_types=C.default_layer_types(12)))
    from baro_jax.tokenizer import ByteTokenizer
    p = synthetic_params(cfg, seed=3, dtype=jnp.float32)
    lg = baro_jax.Engine(cfg, p, ByteTokenizer(), backend="xla").prompt_logits(ids)
    assert np.all(np.isfinite(lg)) and 1.0 < float(np.std(lg[-1])) < 50.0
