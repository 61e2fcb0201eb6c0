"""Config parsing: both architectures, nested text_config, layer_types, errors."""
import json

import pytest

from baro_jax import config as C
from baro_jax.config import FULL, LINEAR, ConfigError

# Shapes of the real checkpoints' config.json (abridged to the fields that matter).
QWEN35_OFFICIAL = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu",
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "full_attention_interval": 4, "attn_output_gate": True,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    },
    "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 27},
}

QWEN3_NEXT_OFFICIAL = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "hidden_act": "silu", "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "full_attention_interval": 4, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
    "rope_scaling": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
}


def _preset_equal(cfg, name, **skip):
    want = C.preset(name)
    for f in ("vocab_size", "hidden_size", "num_layers", "layer_types", "num_heads", "num_kv_heads", "head_dim",
              "rope_theta", "partial_rotary_factor", "lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim",
              "conv_kernel", "num_experts", "top_k", "moe_inter", "shared_inter", "rms_eps", "tie_word_embeddings"):
        assert getattr(cfg, f) == getattr(want, f), f


def test_qwen35_nested_text_config():
    cfg = C.from_hf_dict(QWEN35_OFFICIAL)
    assert cfg.model_type == "qwen3_5_moe"
    _preset_equal(cfg, "qwen3.5-35b-a3b")
    assert cfg.rotary_dim == 64 and cfg.conv_dim == 8192 and cfg.attn_qkv_dim == (32 + 4) * 256
    assert cfg.gdn_in_dim == 8192 + 4096 + 64
    assert cfg.layer_types[3] == FULL and cfg.layer_types[0] == LINEAR


def test_qwen35_text_only():
    raw = dict(QWEN35_OFFICIAL["text_config"], tie_word_embeddings=False)
    cfg = C.from_hf_dict(raw)
    assert cfg.model_type == "qwen3_5_moe_text"
    _preset_equal(cfg, "qwen3.5-35b-a3b")


def test_qwen3_next_top_level_rope():
    cfg = C.from_hf_dict(QWEN3_NEXT_OFFICIAL)
    assert cfg.model_type == "qwen3_next"
    _preset_equal(cfg, "qwen3-next-80b-a3b")
    assert cfg.rope_theta == 1e7 and cfg.rotary_dim == 64


def test_layer_types_honoured_and_default_interval():
    lt = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    raw = dict(QWEN3_NEXT_OFFICIAL, num_hidden_layers=4, layer_types=lt)
    assert C.from_hf_dict(raw).layer_types == tuple(lt)
    raw = dict(QWEN3_NEXT_OFFICIAL, num_hidden_layers=6, full_attention_interval=3)
    assert C.from_hf_dict(raw).layer_types == (LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL)
    raw = dict(QWEN3_NEXT_OFFICIAL, num_hidden_layers=3, layer_types=lt)
    with pytest.raises(ConfigError, match="layer_types has 4 entries, num_hidden_layers is 3"):
        C.from_hf_dict(raw)
    with pytest.raises(ConfigError, match="unknown layer type"):
        C.from_hf_dict(dict(QWEN3_NEXT_OFFICIAL, num_hidden_layers=1, layer_types=["sliding_attention"]))


def test_transformers_saved_configs(tmp_path):
    """config.json as written by transformers 5 save_pretrained for all three classes."""
    import hf_util
    for arch in ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"):
        hc = hf_util.hf_config(arch, partial_rotary_factor=0.5, rope_theta=5e5)
        d = tmp_path / arch
        hc.save_pretrained(d)
        cfg = C.load_config(str(d))
        assert cfg.model_type == arch
        assert cfg.hidden_size == 64 and cfg.num_layers == 4 and cfg.head_dim == 32
        assert cfg.layer_types == (LINEAR, LINEAR, LINEAR, FULL)
        assert cfg.rotary_dim == 16 and cfg.rope_theta == 5e5
        assert cfg.lin_k_heads == 2 and cfg.lin_v_heads == 4 and cfg.num_experts == 8 and cfg.top_k == 2


def test_unknown_model_type():
    with pytest.raises(ConfigError, match=r"unknown model_type 'qwen3_moe'; baro_jax supports qwen3_5_moe"):
        C.from_hf_dict(dict(QWEN3_NEXT_OFFICIAL, model_type="qwen3_moe"))
    with pytest.raises(ConfigError, match="has no 'model_type'"):
        C.from_hf_dict({k: v for k, v in QWEN3_NEXT_OFFICIAL.items() if k != "model_type"})


def test_missing_fields():
    raw = {k: v for k, v in QWEN3_NEXT_OFFICIAL.items() if k != "linear_num_value_heads"}
    with pytest.raises(ConfigError, match=r"config.json \(qwen3_next\) is missing required field 'linear_num_value_heads'"):
        C.from_hf_dict(raw)
    raw = json.loads(json.dumps(QWEN35_OFFICIAL))
    del raw["text_config"]["num_experts"]
    with pytest.raises(ConfigError, match=r"config.json \(qwen3_5_moe\) is missing required field 'num_experts'"):
        C.from_hf_dict(raw)
    with pytest.raises(ConfigError, match=r"missing required field 'text_config'"):
        C.from_hf_dict({"model_type": "qwen3_5_moe"})
    raw = {k: v for k, v in QWEN3_NEXT_OFFICIAL.items() if k != "rope_theta"}
    with pytest.raises(ConfigError, match="has no rope_theta"):
        C.from_hf_dict(raw)


def test_unsupported_variants():
    for change, msg in [
        (dict(norm_topk_prob=False), "norm_topk_prob=false"),
        (dict(mlp_only_layers=[0]), "mlp_only_layers"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'"),
        (dict(linear_num_value_heads=24, linear_num_key_heads=16), "not a multiple of linear_num_key_heads"),
        (dict(num_experts_per_tok=600), "num_experts_per_tok 600"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            C.from_hf_dict(dict(QWEN3_NEXT_OFFICIAL, **change))


def test_load_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        C.load_config(str(tmp_path))


def test_presets():
    for name in C.PRESETS:
        cfg = C.preset(name, max_context=1024)
        assert cfg.max_context == 1024
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        C.preset("nope")
