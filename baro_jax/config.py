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
    """One of DELTA_RULES (the setting itself, BARO_DELTA included, is read by settings.py)."""
    if rule not in DELTA_RULES:
        raise ValueError(f"{where} must be one of {', '.join(DELTA_RULES)}, got {rule!r}")
    return rule

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


class ConfigError(ValueError):
    """A checkpoint's config.json cannot be turned into a Config."""


_MISSING = object()
MAX_CONTEXT_LIMIT = 1 << 24  # a sanity bound for context lengths, presets and Configs built by hand


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
        """Check types, ranges and divisibility; every message names the config.json field."""
        for f, (hf, lo, hi) in _INT_FIELDS.items():
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{where}: {hf} must be an integer in [{lo}, {hi}], got {v!r}")
        for f, (hf, lo, lo_open, hi) in _FLOAT_FIELDS.items():
            v = getattr(self, f)
            if not _in_float_range(v, lo, lo_open, hi):
                raise ConfigError(f"{where}: {hf} must be a number {_float_range(lo, lo_open, hi)}, got {v!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"{where}: tie_word_embeddings must be a boolean, got {self.tie_word_embeddings!r}")
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
            n = len(self.layer_types) if isinstance(self.layer_types, (tuple, list)) else self.layer_types
            raise ConfigError(f"{where}: layer_types must have num_hidden_layers={self.num_layers} entries, got {n!r}")
        bad = sorted({t for t in self.layer_types if t not in (FULL, LINEAR)}, key=repr)
        if bad:
            raise ConfigError(f"{where}: unknown layer type(s) {bad} in layer_types; expected {FULL!r} or {LINEAR!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if self.lin_v_heads % self.lin_k_heads:
            raise ConfigError(f"{where}: linear_num_value_heads {self.lin_v_heads} is not a multiple of "
                              f"linear_num_key_heads {self.lin_k_heads}")
        if self.delta_rule not in DELTA_RULES:
            raise ConfigError(f"delta_rule must be one of {', '.join(DELTA_RULES)}, got {self.delta_rule!r}")
        if self.conv_kernel != 4:
            raise ConfigError(f"{where}: linear_conv_kernel_dim {self.conv_kernel} is not supported (only 4)")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"{where}: the rotary dim int(head_dim {self.head_dim} x partial_rotary_factor "
                              f"{self.partial_rotary_factor}) = {self.rotary_dim} must be even and >= 2")
        if self.top_k > self.num_experts:
            raise ConfigError(f"{where}: num_experts_per_tok {self.top_k} must be in [1, num_experts={self.num_experts}]")
        return self


# Integer Config fields: config.json name and the accepted range. The upper bounds are far past
# every released model (so a typo or an overflowed value is refused before anything is sized by it).
_INT_FIELDS = {
    "vocab_size": ("vocab_size", 1, 1 << 24), "hidden_size": ("hidden_size", 1, 1 << 16),
    "num_layers": ("num_hidden_layers", 1, 1 << 12),
    "num_heads": ("num_attention_heads", 1, 1 << 12), "num_kv_heads": ("num_key_value_heads", 1, 1 << 12),
    "head_dim": ("head_dim", 1, 1 << 12),
    "lin_k_heads": ("linear_num_key_heads", 1, 1 << 12), "lin_v_heads": ("linear_num_value_heads", 1, 1 << 12),
    "lin_k_dim": ("linear_key_head_dim", 1, 1 << 12), "lin_v_dim": ("linear_value_head_dim", 1, 1 << 12),
    "conv_kernel": ("linear_conv_kernel_dim", 1, 1 << 12), "num_experts": ("num_experts", 1, 1 << 16),
    "top_k": ("num_experts_per_tok", 1, 1 << 16),
    "moe_inter": ("moe_intermediate_size", 1, 1 << 18),
    "shared_inter": ("shared_expert_intermediate_size", 1, 1 << 18),
    "max_context": ("max_context", 1, MAX_CONTEXT_LIMIT),
}
_CTX_FIELD = ("max_position_embeddings", 1, MAX_CONTEXT_LIMIT)
_INTERVAL_FIELD = ("full_attention_interval", 1, 1 << 12)

# Float Config fields: config.json name, lower bound, whether it is excluded, upper bound.
# rms_norm_eps: at least float32's smallest normal, so it never flushes to zero (rsqrt(0) of an
# all-zero row), and at most 1, past which the norm no longer normalises. rope_theta > 1: the
# rotary frequencies theta^(-2i/d) must fall with i (theta <= 1 makes them 1 or growing ones that
# overflow the angles). partial_rotary_factor in (0, 1]: a part of head_dim.
_FLOAT_FIELDS = {
    "rms_eps": ("rms_norm_eps", 2.0 ** -126, False, 1.0),
    "rope_theta": ("rope_theta", 1.0, True, math.inf),
    "partial_rotary_factor": ("partial_rotary_factor", 0.0, True, 1.0),
}


def _in_float_range(v, lo: float, lo_open: bool, hi: float) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    return (v > lo if lo_open else v >= lo) and v <= hi


def _float_range(lo: float, lo_open: bool, hi: float) -> str:
    if hi == math.inf:
        return f"finite and {'>' if lo_open else '>='} {lo:.3g}"
    return f"in {'(' if lo_open else '['}{lo:.3g}, {hi:.3g}]"


def default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


class _Fields:
    """Typed reads of one config.json object; every error names the file (and object), the field,
    what is expected and what was given."""

    def __init__(self, d: dict, where: str):
        self.d, self.where = d, where

    def fail(self, key: str, want: str, v: Any = _MISSING):
        got = "" if v is _MISSING else f", got {v}" if isinstance(v, _Said) else f", got {_show(v)}"
        raise ConfigError(f"{self.where}: field {key!r} must be {want}{got}")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value; absent or null means the default (transformers' for these classes), or an
        error when there is none."""
        v = self.d.get(key)
        if v is None:
            if default is _MISSING:
                raise ConfigError(f"{self.where} is missing required field {key!r}" if key not in self.d
                                  else f"{self.where}: required field {key!r} is null")
            return default
        return v

    def integer(self, key: str, lo: int, hi: int, default: Any = _MISSING) -> int:
        v = self.get(key, default)
        # JSON integers only: 2048.0 or 1e300 are floats, and a float is never a size.
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            self.fail(key, f"an integer in [{lo}, {hi}]", v)
        return v

    def number(self, key: str, lo: float, lo_open: bool, hi: float, v: Any = _MISSING) -> float:
        v = self.get(key) if v is _MISSING else v
        if not _in_float_range(v, lo, lo_open, hi):
            self.fail(key, f"a number {_float_range(lo, lo_open, hi)}", v)
        return float(v)

    def boolean(self, key: str, default: bool) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):  # "false" is a non-empty string: truthy
            self.fail(key, "a JSON boolean (true or false)", v)
        return v

    def string(self, key: str, default: str) -> str:
        v = self.get(key, default)
        if not isinstance(v, str):
            self.fail(key, "a string", v)
        return v

    def obj(self, key: str, required: bool = False) -> dict | None:
        v = self.get(key) if required else self.d.get(key)
        if v is not None and not isinstance(v, dict):
            self.fail(key, "a JSON object", v)
        return v


class _Said(str):
    """A description of a given value, shown as it is."""


def _show(v: Any) -> str:
    s = repr(v)
    return f"{type(v).__name__} {s if len(s) <= 80 else s[:77] + '...'}"


def from_hf_dict(raw: dict, max_context: int | None = None, source: str = "config.json") -> Config:
    """Build a Config from a transformers config.json dict (either architecture). `source` names
    the file in messages. Absent or null optional fields take transformers' defaults for these
    classes (head_dim 256, partial_rotary_factor 0.25, max_position_embeddings 32768, ...)."""
    if max_context is not None:
        check_max_context(max_context, None, "")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must hold a JSON object, got {type(raw).__name__}")
    mt = raw.get("model_type")
    if mt is None:
        raise ConfigError(f"{source} has no 'model_type'")
    if not isinstance(mt, str) or mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{source}: unknown model_type {mt!r}; baro_jax supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    top = _Fields(raw, f"{source} ({mt})")
    f = top
    if mt == "qwen3_5_moe":
        f = _Fields(top.obj("text_config", required=True), f"{source} ({mt} text_config)")
        sub = f.d.get("model_type")
        if sub is not None and sub != "qwen3_5_moe_text":
            f.fail("model_type", "'qwen3_5_moe_text' (the text model of qwen3_5_moe)", sub)
    d = f.d
    n_layers = f.integer("num_hidden_layers", *_INT_FIELDS["num_layers"][1:])
    if d.get("layer_types") is not None:
        lt = d["layer_types"]
        want = f"a list of num_hidden_layers={n_layers} entries, each {FULL!r} or {LINEAR!r}"
        if not isinstance(lt, list):
            f.fail("layer_types", want, lt)
        if len(lt) != n_layers:
            f.fail("layer_types", want, _Said(f"{len(lt)} entries"))
        bad = [(i, t) for i, t in enumerate(lt) if t not in (FULL, LINEAR)]
        if bad:
            f.fail("layer_types", want, _Said(f"entry {bad[0][0]} {_show(bad[0][1])} (unknown layer type)"))
        layer_types = tuple(lt)
    else:
        layer_types = default_layer_types(n_layers, f.integer("full_attention_interval", *_INTERVAL_FIELD[1:], default=4))
    # transformers 5 writes rope_parameters; older files rope_scaling (often null) with rope_theta
    # and partial_rotary_factor at the top level. A key inside the rope object wins.
    if d.get("rope_parameters") is not None and d.get("rope_scaling") is not None \
            and d["rope_parameters"] != d["rope_scaling"]:  # transformers would take rope_scaling: ambiguous
        raise ConfigError(f"{f.where}: fields 'rope_parameters' and 'rope_scaling' are both given and differ; "
                          "keep one (rope_parameters)")
    rkey = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    rope = f.obj(rkey) or {}
    r = _Fields(rope, f"{f.where} {rkey}")

    def rope_field(key, default=_MISSING):
        if rope.get(key) is not None:
            return r, rope[key]
        return f, f.get(key, default)

    if rope.get("rope_theta") is None and d.get("rope_theta") is None:
        raise ConfigError(f"{f.where} has no rope_theta (neither top level nor {rkey})")
    fr, v = rope_field("rope_theta")
    rope_theta = fr.number("rope_theta", *_FLOAT_FIELDS["rope_theta"][1:], v=v)
    fr, v = rope_field("partial_rotary_factor", 0.25)
    prf = fr.number("partial_rotary_factor", *_FLOAT_FIELDS["partial_rotary_factor"][1:], v=v)
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in (None, "default"):
        raise ConfigError(f"{r.where}: rope_type {rope_type!r} is not supported (only plain rope, 'default')")
    model_ctx = f.integer("max_position_embeddings", *_CTX_FIELD[1:], default=32768)
    ints = {k: f.integer(hf, lo, hi) for k, (hf, lo, hi) in _INT_FIELDS.items()
            if k not in ("num_layers", "head_dim", "max_context")}
    tie = top.boolean("tie_word_embeddings", False)
    if f is not top and f.boolean("tie_word_embeddings", tie) != tie:
        # transformers ties qwen3_5_moe's lm_head by the top-level flag alone (absent: false)
        raise ConfigError(f"{f.where}: field 'tie_word_embeddings' is {f.d['tie_word_embeddings']} but the top-level "
                          f"flag, the one transformers reads, is {tie}{'' if 'tie_word_embeddings' in raw else ' (absent)'}"
                          "; make them agree")
    cfg = Config(
        model_type=mt, num_layers=n_layers, layer_types=layer_types,
        head_dim=f.integer("head_dim", *_INT_FIELDS["head_dim"][1:], default=256),
        rope_theta=rope_theta, partial_rotary_factor=prf,
        rms_eps=f.number("rms_norm_eps", *_FLOAT_FIELDS["rms_eps"][1:], v=f.get("rms_norm_eps", 1e-6)),
        max_context=min(model_ctx, 262144) if max_context is None else check_max_context(
            max_context, model_ctx, f"max_position_embeddings in {source}"),
        tie_word_embeddings=tie, **ints,
    )
    if mt == "qwen3_next":
        mlp_only = d.get("mlp_only_layers")
        if mlp_only is not None and not isinstance(mlp_only, list):
            f.fail("mlp_only_layers", "a list of layer indices", mlp_only)
        if mlp_only:
            raise ConfigError(f"{f.where}: mlp_only_layers {mlp_only!r:.80} (dense MLP layers) is not supported")
        if f.integer("decoder_sparse_step", 1, n_layers, default=1) != 1:
            raise ConfigError(f"{f.where}: decoder_sparse_step != 1 is not supported")
        if not f.boolean("norm_topk_prob", True):
            raise ConfigError(f"{f.where}: norm_topk_prob=false is not supported (top-k weights are always renormalised)")
    if f.string("hidden_act", "silu") != "silu":
        raise ConfigError(f"{f.where}: hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    if f.boolean("attention_bias", False):
        raise ConfigError(f"{f.where}: attention_bias=true is not supported")
    if not f.boolean("attn_output_gate", True):
        raise ConfigError(f"{f.where}: attn_output_gate=false is not supported (both architectures gate attention)")
    return cfg.validate(where=f.where)


def check_max_context(max_context, model_ctx: int | None, what: str) -> int:
    """A requested context length (load(max_context=), --max-context): a positive integer no larger
    than the model's (model_ctx None: checked later, against the model). The messages blame the
    request, never the checkpoint."""
    if isinstance(max_context, bool) or not isinstance(max_context, int):
        raise ConfigError(f"max_context (--max-context) must be a positive integer, "
                          f"got {type(max_context).__name__} {max_context!r}")
    if max_context < 1:
        raise ConfigError(f"max_context (--max-context) must be >= 1, got {max_context}")
    if model_ctx is not None and max_context > model_ctx:
        raise ConfigError(f"max_context (--max-context) {max_context} is beyond the model's context of {model_ctx} "
                          f"({what}); refused before allocating anything")
    return max_context


def load_config(path: str, max_context: int | None = None) -> Config:
    if max_context is not None:  # a bad request is the caller's, whatever the checkpoint holds
        check_max_context(max_context, None, "")
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
    return from_hf_dict(raw, max_context, source=f)


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
