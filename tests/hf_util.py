"""Helpers to build tiny random transformers models of both architectures (CPU, float32).

The weights are re-drawn with larger scales than transformers' init (std 0.02
gives near-uniform logits where greedy ties are fragile): matrices ~ N(0, 1/fan_in),
embeddings ~ N(0, 1), lm_head ~ 4/sqrt(D) (logits of std ~4), router ~ 2/sqrt(D),
zero-centred norm weights ~ N(0, 0.2^2), gated-norm weight ~ 1 + N(0, 0.1^2),
conv taps ~ N(0, 0.5^2), A_log = log U(1, 16), dt_bias ~ N(0, 0.5^2) - 1.
"""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import torch

import transformers as T
from safetensors.numpy import save_file

# Shared shape defaults of the tiny configs (GQA 2, nv/nk 2, both layer types).
BASE = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, rms_norm_eps=1e-6, max_position_embeddings=4096,
)

TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                   num_position_embeddings=16, patch_size=4)

EAGER = dict(attn_implementation="eager", experts_implementation="eager")


def _rope(kw: dict) -> dict:
    theta = kw.pop("rope_theta", 10000.0)
    prf = kw.pop("partial_rotary_factor", 0.25)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": prf}
    return kw


def hf_config(arch: str, **overrides):
    """A transformers config. arch: 'qwen3_next' (Qwen3NextConfig), 'qwen3_5_moe_text'
    (Qwen3_5MoeTextConfig, for Qwen3_5MoeForCausalLM) or 'qwen3_5_moe' (Qwen3_5MoeConfig with a
    tiny vision tower, for Qwen3_5MoeForConditionalGeneration)."""
    kw = _rope({**BASE, **overrides})
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    if arch == "qwen3_next":
        return T.Qwen3NextConfig(**kw, **EAGER)
    if arch == "qwen3_5_moe_text":
        return T.Qwen3_5MoeTextConfig(**kw, **EAGER)
    if arch == "qwen3_5_moe":
        tie = kw.pop("tie_word_embeddings", False)
        return T.Qwen3_5MoeConfig(text_config=kw, vision_config=dict(TINY_VISION, out_hidden_size=kw["hidden_size"]),
                                  tie_word_embeddings=tie, **EAGER)
    raise ValueError(arch)


def model_class(config):
    return {
        "qwen3_next": T.Qwen3NextForCausalLM,
        "qwen3_5_moe_text": T.Qwen3_5MoeForCausalLM,
        "qwen3_5_moe": T.Qwen3_5MoeForConditionalGeneration,
    }[config.model_type]


def text_config(config):
    return config.text_config if config.model_type == "qwen3_5_moe" else config


@torch.no_grad()
def randomize_(model, seed: int) -> None:
    """Re-draw every language-model weight with the scales in the module docstring."""
    g = torch.Generator().manual_seed(seed)
    tc = text_config(model.config)
    D = tc.hidden_size

    def normal(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std + mean)

    for name, p in model.named_parameters():
        if "visual" in name:
            continue
        if name.endswith("embed_tokens.weight"):
            normal(p, 1.0)
        elif name == "lm_head.weight":
            normal(p, 4.0 / math.sqrt(D))
        elif name.endswith("mlp.gate.weight"):
            normal(p, 2.0 / math.sqrt(D))
        elif name.endswith("mlp.experts.gate_up_proj"):
            normal(p, 1.0 / math.sqrt(p.shape[-1]))
        elif name.endswith("mlp.experts.down_proj"):
            normal(p, 1.0 / math.sqrt(p.shape[-1]))
        elif name.endswith("linear_attn.norm.weight"):
            normal(p, 0.1, 1.0)
        elif name.endswith("norm.weight"):  # zero-centred RMSNorms (input/post/final/q/k)
            normal(p, 0.2)
        elif name.endswith("conv1d.weight"):
            normal(p, 0.5)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15.0 + 1.0))
        elif name.endswith("dt_bias"):
            normal(p, 0.5, -1.0)
        elif p.ndim == 2:
            normal(p, 1.0 / math.sqrt(p.shape[1]))
        else:
            raise AssertionError(f"randomize_: no rule for {name} {tuple(p.shape)}")
    if getattr(model.config, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False):
        model.tie_weights()


def build(arch: str, seed: int = 0, **overrides):
    """A tiny float32 eval-mode model with randomized weights (seeded)."""
    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = model_class(config)(config).float().eval()
    randomize_(model, seed)
    return model


def save(model, path: str) -> str:
    model.save_pretrained(path)
    return path


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy().copy() for k, v in model.state_dict().items()}


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def to_fused(tensors: dict[str, np.ndarray], num_experts: int) -> dict[str, np.ndarray]:
    """Per-expert expert tensors -> fused gate_up_proj [E, 2I, D] (gate rows first) and down_proj [E, D, I]."""
    out, groups = {}, {}
    for k, v in tensors.items():
        m = _PER_EXPERT.match(k)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
        else:
            out[k] = v
    for base, g in groups.items():
        out[base + ".gate_up_proj"] = np.stack(
            [np.concatenate([g[(e, "gate")], g[(e, "up")]], axis=0) for e in range(num_experts)])
        out[base + ".down_proj"] = np.stack([g[(e, "down")] for e in range(num_experts)])
    return out


def read_safetensors_dir(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def write_official_qwen35(saved_dir: str, out_dir: str, junk: bool = True, shards: int = 1) -> str:
    """Rewrite a transformers save of a qwen3_5_moe(_text) model in the official Qwen3.5 layout:
    prefix model.language_model., fused experts, nested qwen3_5_moe config.json, plus mtp.* and
    model.visual.* tensors (to be ignored) when junk. shards > 1 writes an index."""
    cfg = json.load(open(os.path.join(saved_dir, "config.json")))
    tensors = read_safetensors_dir(saved_dir)
    if cfg["model_type"] == "qwen3_5_moe_text":
        text = dict(cfg)
        cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": text, "tie_word_embeddings": text.get("tie_word_embeddings", False),
               "vision_config": {"depth": 1, "model_type": "qwen3_5_moe_vision"}}
        tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in tensors.items()}
    tensors = to_fused(tensors, cfg["text_config"]["num_experts"])
    if junk:
        rng = np.random.default_rng(1)
        E, D = cfg["text_config"]["num_experts"], cfg["text_config"]["hidden_size"]
        tensors.update({
            "mtp.fc.weight": rng.standard_normal((D, 2 * D), dtype=np.float32),
            "mtp.layers.0.mlp.experts.0.gate_proj.weight": rng.standard_normal((8, D), dtype=np.float32),
            "mtp.layers.0.mlp.gate.weight": rng.standard_normal((E, D), dtype=np.float32),
            "model.visual.patch_embed.proj.weight": rng.standard_normal((4, 3, 2, 2, 2), dtype=np.float32),
            "model.visual.blocks.0.norm1.weight": rng.standard_normal((4,), dtype=np.float32),
        })
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    names = sorted(tensors)
    if shards <= 1:
        save_file({k: np.ascontiguousarray(tensors[k]) for k in names}, os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            save_file({k: np.ascontiguousarray(tensors[k]) for k in part}, os.path.join(out_dir, fn))
            weight_map.update({k: fn for k in part})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh, indent=1)
    return out_dir
