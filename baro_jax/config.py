"""Model configuration: one dataclass for both Qwen3.5-MoE and Qwen3-Next."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

FULL = "full_attention"
LINEAR = "linear_attention"

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


class ConfigError(ValueError):
    """A checkpoint's config.json cannot be turned into a Config."""


@dataclasses.dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    # gated attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated deltanet
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    # moe
    num_experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    rms_eps: float = 1e-6
    max_context: int = 32768
    tie_word_embeddings: bool = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    @property
    def attn_qkv_dim(self) -> int:
        return (2 * self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def gdn_in_dim(self) -> int:
        """Rows of the fused GDN input projection: qkv | z | b | a."""
        return self.conv_dim + self.lin_v_heads * self.lin_v_dim + 2 * self.lin_v_heads

    def validate(self) -> "Config":
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_layers}")
        bad = sorted(set(self.layer_types) - {FULL, LINEAR})
        if bad:
            raise ConfigError(f"unknown layer type(s) {bad}; expected {FULL!r} or {LINEAR!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if self.lin_v_heads % self.lin_k_heads:
            raise ConfigError(f"linear_num_value_heads {self.lin_v_heads} is not a multiple of linear_num_key_heads {self.lin_k_heads}")
        if self.conv_kernel != 4:
            raise ConfigError(f"linear_conv_kernel_dim {self.conv_kernel} is not supported (only 4)")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and <= head_dim {self.head_dim}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.top_k} must be in [1, num_experts={self.num_experts}]")
        return self


def default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def _need(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"config.json ({where}) is missing required field {key!r}")
    return d[key]


def from_hf_dict(raw: dict, max_context: int | None = None) -> Config:
    """Build a Config from a transformers config.json dict (either architecture)."""
    mt = raw.get("model_type")
    if mt is None:
        raise ConfigError("config.json has no 'model_type'")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unknown model_type {mt!r}; baro_jax supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    d = raw
    if mt == "qwen3_5_moe":
        d = _need(raw, "text_config", mt)
        d = dict(d)
    where = mt
    n_layers = int(_need(d, "num_hidden_layers", where))
    if d.get("layer_types"):
        layer_types = tuple(d["layer_types"])
    else:
        layer_types = default_layer_types(n_layers, int(d.get("full_attention_interval", 4)))
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", d.get("rope_theta"))
    if rope_theta is None:
        raise ConfigError(f"config.json ({where}) has no rope_theta (neither top level nor rope_parameters)")
    prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    hidden = int(_need(d, "hidden_size", where))
    n_heads = int(_need(d, "num_attention_heads", where))
    cfg = Config(
        model_type=mt,
        vocab_size=int(_need(d, "vocab_size", where)),
        hidden_size=hidden,
        num_layers=n_layers,
        layer_types=layer_types,
        num_heads=n_heads,
        num_kv_heads=int(_need(d, "num_key_value_heads", where)),
        head_dim=int(d.get("head_dim") or hidden // n_heads),
        rope_theta=float(rope_theta),
        partial_rotary_factor=float(prf),
        lin_k_heads=int(_need(d, "linear_num_key_heads", where)),
        lin_v_heads=int(_need(d, "linear_num_value_heads", where)),
        lin_k_dim=int(_need(d, "linear_key_head_dim", where)),
        lin_v_dim=int(_need(d, "linear_value_head_dim", where)),
        conv_kernel=int(_need(d, "linear_conv_kernel_dim", where)),
        num_experts=int(_need(d, "num_experts", where)),
        top_k=int(_need(d, "num_experts_per_tok", where)),
        moe_inter=int(_need(d, "moe_intermediate_size", where)),
        shared_inter=int(_need(d, "shared_expert_intermediate_size", where)),
        rms_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_context=int(max_context or min(int(d.get("max_position_embeddings", 32768)), 262144)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", d.get("tie_word_embeddings", False))),
    )
    if mt == "qwen3_next":
        if d.get("mlp_only_layers"):
            raise ConfigError("qwen3_next with mlp_only_layers (dense MLP layers) is not supported")
        if int(d.get("decoder_sparse_step", 1)) != 1:
            raise ConfigError("qwen3_next with decoder_sparse_step != 1 is not supported")
    if mt == "qwen3_next" and d.get("norm_topk_prob", True) is False:
        raise ConfigError("qwen3_next with norm_topk_prob=false is not supported (top-k weights are always renormalised)")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only plain rope, 'default')")
    if d.get("attn_output_gate") is False:
        raise ConfigError("attn_output_gate=false is not supported (both architectures gate attention)")
    return cfg.validate()


def load_config(path: str, max_context: int | None = None) -> Config:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ConfigError(f"no config.json in checkpoint directory {path!r}")
    with open(f) as fh:
        return from_hf_dict(json.load(fh), max_context)


# Presets with real shapes (weights are synthetic, see weights.synthetic_params).
PRESETS = {
    "qwen3.5-35b-a3b": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_layers=40,
        layer_types=default_layer_types(40), num_heads=16, num_kv_heads=2, head_dim=256,
        rope_theta=1e7, partial_rotary_factor=0.25, lin_k_heads=16, lin_v_heads=32,
        lin_k_dim=128, lin_v_dim=128, conv_kernel=4, num_experts=256, top_k=8,
        moe_inter=512, shared_inter=512, max_context=131072),
    "qwen3-next-80b-a3b": dict(
        model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_layers=48,
        layer_types=default_layer_types(48), num_heads=16, num_kv_heads=2, head_dim=256,
        rope_theta=1e7, partial_rotary_factor=0.25, lin_k_heads=16, lin_v_heads=32,
        lin_k_dim=128, lin_v_dim=128, conv_kernel=4, num_experts=512, top_k=10,
        moe_inter=512, shared_inter=512, max_context=131072),
    # Random-weight demo model: small, both layer types, GQA 2, nv/nk 2, 8 experts.
    "tiny-random": dict(
        model_type="qwen3_5_moe_text", vocab_size=256, hidden_size=64, num_layers=4,
        layer_types=default_layer_types(4), num_heads=4, num_kv_heads=2, head_dim=32,
        rope_theta=1e4, partial_rotary_factor=0.5, lin_k_heads=2, lin_v_heads=4,
        lin_k_dim=16, lin_v_dim=16, conv_kernel=4, num_experts=8, top_k=2,
        moe_inter=32, shared_inter=32, max_context=4096),
}


def preset(name: str, max_context: int | None = None) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    kw = dict(PRESETS[name])
    if max_context:
        kw["max_context"] = max_context
    return Config(**kw).validate()
