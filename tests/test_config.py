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
    with pytest.raises(ConfigError, match="field 'layer_types' must be a list of num_hidden_layers=3 entries.*got 4 entries"):
        C.from_hf_dict(raw)
    with pytest.raises(ConfigError, match="got entry 0 str 'sliding_attention' \\(unknown layer type\\)"):
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
    with pytest.raises(ConfigError, match=r"config.json \(qwen3_5_moe text_config\) is missing required field 'num_experts'"):
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


@pytest.mark.parametrize("change,msg", [
    (dict(norm_topk_prob="false"), "field 'norm_topk_prob' must be a JSON boolean (true or false), got str 'false'"),
    (dict(norm_topk_prob=0), "field 'norm_topk_prob' must be a JSON boolean"),
    (dict(mlp_only_layers=0), "field 'mlp_only_layers' must be a list of layer indices, got int 0"),
    (dict(mlp_only_layers=""), "field 'mlp_only_layers' must be a list of layer indices, got str ''"),
    (dict(decoder_sparse_step=1.0), "field 'decoder_sparse_step' must be an integer in [1, 48], got float 1.0"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step != 1 is not supported"),
    (dict(rope_theta=1e-300), "config.json (qwen3_next): field 'rope_theta' must be a number finite and > 1, got float 1e-300"),
    (dict(partial_rotary_factor="0.25"), "config.json (qwen3_next): field 'partial_rotary_factor' must be a number in (0, 1]"),
    (dict(rope_scaling="default"), "config.json (qwen3_next): field 'rope_scaling' must be a JSON object, got str 'default'"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": 0.0}),
     "config.json (qwen3_next) rope_scaling: field 'rope_theta' must be a number finite and > 1, got float 0.0"),
    (dict(tie_word_embeddings="false"), "config.json (qwen3_next): field 'tie_word_embeddings' must be a JSON boolean"),
    (dict(max_position_embeddings=262144.0), "field 'max_position_embeddings' must be an integer in [1, 16777216], got float 262144.0"),
    (dict(linear_num_value_heads=None), "config.json (qwen3_next): required field 'linear_num_value_heads' is null"),
    (dict(model_type=["qwen3_next"]), "unknown model_type ['qwen3_next']"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": 9e5}, rope_parameters={"rope_theta": 7e5}),
     "config.json (qwen3_next): fields 'rope_parameters' and 'rope_scaling' are both given and differ; keep one"),
])
def test_qwen3_next_fields_checked(change, msg):
    with pytest.raises(ConfigError) as ei:
        C.from_hf_dict(dict(QWEN3_NEXT_OFFICIAL, **change))
    assert msg in str(ei.value)


def _nested(text=None, **top):
    raw = json.loads(json.dumps(QWEN35_OFFICIAL))
    raw["text_config"].update(text or {})
    raw.update(top)
    return raw


@pytest.mark.parametrize("raw,msg", [
    (_nested(tie_word_embeddings="false"), "config.json (qwen3_5_moe): field 'tie_word_embeddings' must be a JSON boolean"),
    (_nested({"tie_word_embeddings": "yes"}),
     "config.json (qwen3_5_moe text_config): field 'tie_word_embeddings' must be a JSON boolean"),
    (_nested({"model_type": "qwen3_next"}), "field 'model_type' must be 'qwen3_5_moe_text' (the text model of qwen3_5_moe), got str 'qwen3_next'"),
    (_nested({"rms_norm_eps": 1e30}), "config.json (qwen3_5_moe text_config): field 'rms_norm_eps' must be a number in [1.18e-38, 1], got float 1e+30"),
    (_nested({"rope_parameters": {"rope_theta": 1e-300}}),
     "config.json (qwen3_5_moe text_config) rope_parameters: field 'rope_theta' must be a number finite and > 1"),
    (_nested({"layer_types": ["full_attention"] * 39}), "num_hidden_layers=40 entries, each 'full_attention' or 'linear_attention', got 39 entries"),
    (_nested({"num_experts_per_tok": 8.0}), "config.json (qwen3_5_moe text_config): field 'num_experts_per_tok' must be an integer"),
    (_nested(text_config="{}"), "config.json (qwen3_5_moe): field 'text_config' must be a JSON object, got str '{}'"),
])
def test_qwen35_nested_fields_checked(raw, msg):
    with pytest.raises(ConfigError) as ei:
        C.from_hf_dict(raw)
    assert msg in str(ei.value)


def test_tie_word_embeddings_as_transformers_reads_it():
    """qwen3_5_moe ties by its top-level flag (absent: false); a text_config flag that disagrees is
    refused rather than one of them silently winning."""
    assert C.from_hf_dict(dict(QWEN3_NEXT_OFFICIAL, tie_word_embeddings=True)).tie_word_embeddings is True
    assert C.from_hf_dict(dict(QWEN3_NEXT_OFFICIAL, tie_word_embeddings=None)).tie_word_embeddings is False
    assert C.from_hf_dict(_nested({"tie_word_embeddings": True}, tie_word_embeddings=True)).tie_word_embeddings is True
    assert C.from_hf_dict(_nested({"tie_word_embeddings": False})).tie_word_embeddings is False
    raw = _nested({"tie_word_embeddings": True})
    del raw["tie_word_embeddings"]
    for r, top in ((_nested({"tie_word_embeddings": True}, tie_word_embeddings=False), "False"), (raw, "False (absent)")):
        with pytest.raises(ConfigError) as ei:
            C.from_hf_dict(r)
        assert str(ei.value) == ("config.json (qwen3_5_moe text_config): field 'tie_word_embeddings' is True but the "
                                 f"top-level flag, the one transformers reads, is {top}; make them agree")


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_absent_optional_fields_take_transformers_defaults(arch):
    """A config.json without head_dim, partial_rotary_factor, max_position_embeddings, rms_norm_eps
    or layer_types means what transformers makes of it, not another guess."""
    import transformers

    base = QWEN3_NEXT_OFFICIAL if arch == "qwen3_next" else QWEN35_OFFICIAL["text_config"]
    raw = {k: v for k, v in base.items() if k not in ("head_dim", "partial_rotary_factor", "max_position_embeddings",
                                                      "rms_norm_eps", "layer_types", "rope_parameters", "rope_scaling")}
    raw.update(model_type=arch, rope_theta=1e6)
    cls = transformers.Qwen3NextConfig if arch == "qwen3_next" else transformers.Qwen3_5MoeTextConfig
    hc = cls(**raw)
    cfg = C.from_hf_dict(raw)
    assert cfg.head_dim == hc.head_dim == 256
    assert cfg.rotary_dim == int(hc.head_dim * hc.rope_parameters["partial_rotary_factor"]) == 64
    assert cfg.rope_theta == hc.rope_parameters["rope_theta"]
    assert cfg.rms_eps == hc.rms_norm_eps and cfg.max_context == hc.max_position_embeddings
    assert list(cfg.layer_types) == hc.layer_types


def test_max_context_request_blamed_on_the_request(tmp_path):
    """A bad max_context is the caller's (--max-context), never config.json's."""
    from bad_input_util import TINY

    for bad, msg in [(0, "max_context (--max-context) must be >= 1, got 0"),
                     (-3, "max_context (--max-context) must be >= 1, got -3"),
                     (2.0, "max_context (--max-context) must be a positive integer, got float 2.0"),
                     ("8", "max_context (--max-context) must be a positive integer, got str '8'")]:
        for load in (lambda: C.load_config(TINY, bad), lambda: C.from_hf_dict(QWEN3_NEXT_OFFICIAL, bad),
                     lambda: C.preset("tiny-random", bad), lambda: C.load_config(str(tmp_path), bad)):
            with pytest.raises(ConfigError) as ei:
                load()
            assert str(ei.value) == msg
    with pytest.raises(ConfigError) as ei:
        C.load_config(TINY, 9000)
    assert str(ei.value).startswith("max_context (--max-context) 9000 is beyond the model's context of 8192 "
                                    "(max_position_embeddings in ")
    with pytest.raises(ConfigError, match=r"^max_context \(--max-context\) 9000 is beyond the model's context of 4096 "
                                          r"\(the tiny-random preset\)"):
        C.preset("tiny-random", 9000)


def test_hand_built_config_validated():
    kw = dict(C.PRESETS["tiny-random"])
    for change, msg in [(dict(rms_eps=1e30), "rms_norm_eps must be a number in [1.18e-38, 1], got 1e+30"),
                        (dict(rope_theta=0.5), "rope_theta must be a number finite and > 1, got 0.5"),
                        (dict(vocab_size=256.0), "vocab_size must be an integer in [1, 16777216], got 256.0"),
                        (dict(tie_word_embeddings="false"), "tie_word_embeddings must be a boolean, got 'false'"),
                        (dict(layer_types=("linear_attention",) * 3), "layer_types must have num_hidden_layers=4 entries"),
                        (dict(max_context=0), "max_context must be an integer in [1, 16777216], got 0")]:
        with pytest.raises(ConfigError) as ei:
            C.Config(**dict(kw, **change)).validate()
        assert msg in str(ei.value)
