"""Model configuration: one dataclass for both Qwen3.5-MoE and Qwen3-Next."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

FULL = "full_attention"
LINEAR = "linear_attention"

DELTA_RULES = ("token", "blocked")
DELTA_BLOCK = 64  # rows per block of the blocked delta rule (absolute positions [64b, 64b + 64))


def check_delta_rule(rule, where: str = "delta_rule") -> str:
    """None -> env BARO_DELTA (token|blocked), unset or empty -> "token"; else one of DELTA_RULES."""
    if rule is None:
        rule = os.environ.get("BARO_DELTA") or "token"
        where = "BARO_DELTA"
    if rule not in DELTA_RULES:
        raise ValueError(f"{where} must be one of {', '.join(DELTA_RULES)}, got {rule!r}")
    return rule

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


class ConfigError(ValueError):
    """A checkpoint's config.json cannot be turned into a Config."""


_MISSING = object()


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
    # Gated DeltaNet recurrence: "token" (per-token rule, the default) or "blocked" (the
    # chunk-aligned rule of docs/DESIGN.md §9, blocks of DELTA_BLOCK rows at absolute positions; opt-in,
    # CPU kernel only). Set at load time (load(delta_rule=), --delta-rule, BARO_DELTA).
    delta_rule: str = "token"

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

    def validate(self, where: str = "config") -> "Config":
        """Check ranges and divisibility; every message names the config.json field."""
        for f, hf in _POSITIVE_INT_FIELDS.items():
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{where}: {hf} must be a positive integer, got {v!r}")
        for f, hf in (("rms_eps", "rms_norm_eps"), ("rope_theta", "rope_theta")):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{where}: {hf} must be a finite number > 0, got {v!r}")
        if not isinstance(self.partial_rotary_factor, (int, float)) or not 0.0 <= self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"{where}: partial_rotary_factor must be in [0, 1], got {self.partial_rotary_factor!r}")
        if not isinstance(self.max_context, int) or not 1 <= self.max_context <= MAX_CONTEXT_LIMIT:
            raise ConfigError(f"{where}: max_context must be an integer in [1, {MAX_CONTEXT_LIMIT}], got {self.max_context!r}")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_layers}")
        bad = sorted(set(self.layer_types) - {FULL, LINEAR})
        if bad:
            raise ConfigError(f"unknown layer type(s) {bad}; expected {FULL!r} or {LINEAR!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if self.lin_v_heads % self.lin_k_heads:
            raise ConfigError(f"linear_num_value_heads {self.lin_v_heads} is not a multiple of linear_num_key_heads {self.lin_k_heads}")
        if self.delta_rule not in DELTA_RULES:
            raise ConfigError(f"{where}: delta_rule must be one of {', '.join(DELTA_RULES)}, got {self.delta_rule!r}")
        if self.conv_kernel != 4:
            raise ConfigError(f"linear_conv_kernel_dim {self.conv_kernel} is not supported (only 4)")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and <= head_dim {self.head_dim}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.top_k} must be in [1, num_experts={self.num_experts}]")
        return self


# Config fields that must be positive integers, with their config.json names.
_POSITIVE_INT_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "lin_k_heads": "linear_num_key_heads", "lin_v_heads": "linear_num_value_heads",
    "lin_k_dim": "linear_key_head_dim", "lin_v_dim": "linear_value_head_dim",
    "conv_kernel": "linear_conv_kernel_dim", "num_experts": "num_experts", "top_k": "num_experts_per_tok",
    "moe_inter": "moe_intermediate_size", "shared_inter": "shared_expert_intermediate_size",
}


def default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def _need(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"config.json ({where}) is missing required field {key!r}")
    if d[key] is None:
        raise ConfigError(f"config.json ({where}): required field {key!r} is null")
    return d[key]


def _int(d: dict, key: str, where: str, default: Any = _MISSING, lo: int | None = 1) -> int:
    """An integer field (a float with no fraction is taken), >= lo; the error names the field."""
    v = _need(d, key, where) if default is _MISSING else (d.get(key) if d.get(key) is not None else default)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"config.json ({where}): field {key!r} must be an integer, got {type(v).__name__} {v!r}")
    if lo is not None and v < lo:
        raise ConfigError(f"config.json ({where}): field {key!r} must be >= {lo}, got {v}")
    return v


def _float(v: Any, key: str, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"config.json ({where}): field {key!r} must be a number, got {type(v).__name__} {v!r}")
    return float(v)


def _obj(v: Any, key: str, where: str) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(f"config.json ({where}): field {key!r} must be a JSON object, got {type(v).__name__}")
    return v


def from_hf_dict(raw: dict, max_context: int | None = None) -> Config:
    """Build a Config from a transformers config.json dict (either architecture)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    mt = raw.get("model_type")
    if mt is None:
        raise ConfigError("config.json has no 'model_type'")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unknown model_type {mt!r}; baro_jax supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    d = raw
    if mt == "qwen3_5_moe":
        d = _obj(_need(raw, "text_config", mt), "text_config", mt)
        d = dict(d)
    where = mt
    n_layers = _int(d, "num_hidden_layers", where)
    if d.get("layer_types"):
        lt = d["layer_types"]
        if not isinstance(lt, list) or not all(isinstance(t, str) for t in lt):
            raise ConfigError(f"config.json ({where}): field 'layer_types' must be a list of strings, got {lt!r:.80}")
        layer_types = tuple(lt)
    else:
        layer_types = default_layer_types(n_layers, _int(d, "full_attention_interval", where, default=4))
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope = _obj(rope, "rope_parameters" if d.get("rope_parameters") else "rope_scaling", where)
    rope_theta = rope.get("rope_theta", d.get("rope_theta"))
    if rope_theta is None:
        raise ConfigError(f"config.json ({where}) has no rope_theta (neither top level nor rope_parameters)")
    prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    hidden = _int(d, "hidden_size", where)
    n_heads = _int(d, "num_attention_heads", where)
    model_ctx = _int(d, "max_position_embeddings", where, default=32768)
    if max_context is not None:
        max_context = check_max_context(max_context, model_ctx, "config.json max_position_embeddings")
    cfg = Config(
        model_type=mt,
        vocab_size=_int(d, "vocab_size", where),
        hidden_size=hidden,
        num_layers=n_layers,
        layer_types=layer_types,
        num_heads=n_heads,
        num_kv_heads=_int(d, "num_key_value_heads", where),
        head_dim=_int(d, "head_dim", where, default=hidden // n_heads),
        rope_theta=_float(rope_theta, "rope_theta", where),
        partial_rotary_factor=_float(prf, "partial_rotary_factor", where),
        lin_k_heads=_int(d, "linear_num_key_heads", where),
        lin_v_heads=_int(d, "linear_num_value_heads", where),
        lin_k_dim=_int(d, "linear_key_head_dim", where),
        lin_v_dim=_int(d, "linear_value_head_dim", where),
        conv_kernel=_int(d, "linear_conv_kernel_dim", where),
        num_experts=_int(d, "num_experts", where),
        top_k=_int(d, "num_experts_per_tok", where),
        moe_inter=_int(d, "moe_intermediate_size", where),
        shared_inter=_int(d, "shared_expert_intermediate_size", where),
        rms_eps=_float(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        max_context=max_context or min(model_ctx, 262144),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", d.get("tie_word_embeddings", False))),
    )
    if mt == "qwen3_next":
        if d.get("mlp_only_layers"):
            raise ConfigError("qwen3_next with mlp_only_layers (dense MLP layers) is not supported")
        if _int(d, "decoder_sparse_step", where, default=1, lo=None) != 1:
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
    return cfg.validate(where=f"config.json ({where})")


MAX_CONTEXT_LIMIT = 1 << 24  # a sanity bound for presets and Configs built by hand


def check_max_context(max_context, model_ctx: int | None, what: str) -> int:
    """A requested context length: a positive integer no larger than the model's."""
    if isinstance(max_context, bool) or not isinstance(max_context, int):
        raise ConfigError(f"max_context (--max-context) must be a positive integer, "
                          f"got {type(max_context).__name__} {max_context!r}")
    if max_context < 1:
        raise ConfigError(f"max_context (--max-context) must be >= 1, got {max_context}")
    limit = model_ctx if model_ctx is not None else MAX_CONTEXT_LIMIT
    if max_context > limit:
        raise ConfigError(f"max_context (--max-context) {max_context} is beyond the model's context of {limit} "
                          f"({what}); refused before allocating anything")
    return max_context


def load_config(path: str, max_context: int | None = None) -> Config:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ConfigError(f"no config.json in checkpoint directory {path!r}")
    try:
        with open(f, encoding="utf-8") as fh:
            raw = json.load(fh)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{f}: cannot be read ({e})") from None
    try:
        return from_hf_dict(raw, max_context)
    except ConfigError as e:
        raise ConfigError(f"{f}: {e}") from None


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
    if max_context is not None:
        kw["max_context"] = check_max_context(max_context, kw["max_context"], f"the {name} preset")
    return Config(**kw).validate()
