"""Write a params tree as a checkpoint directory in the official Qwen3.5 layout.

The inverse of ``weights.load_params`` for the layout the official Qwen3.5-MoE
files use: every tensor under ``model.language_model.``, ``lm_head.weight`` at the
top, fused experts (``mlp.experts.gate_up_proj`` [E, 2I, D], gate rows first, and
``mlp.experts.down_proj`` [E, D, I]), the flat Gated DeltaNet input projections
(``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``), ``conv1d.weight``
as [C, 1, K]. The directory gets a ``config.json`` (``qwen3_5_moe_text``, loadable
by transformers' ``Qwen3_5MoeForCausalLM`` and by baro_jax) and, for byte-level
models, a ``tokenizer.json`` whose ids are the byte values.
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from .config import FULL, Config

__all__ = ["params_to_hf", "hf_config_dict", "write_checkpoint", "byte_tokenizer", "write_byte_tokenizer"]

PREFIX = "model.language_model."


def _np(x, dtype) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32).astype(dtype))


def params_to_hf(params, cfg: Config, dtype=ml_dtypes.bfloat16, prefix: str = PREFIX) -> dict[str, np.ndarray]:
    """{official tensor name: numpy array}. Matrices in ``dtype``; norm weights, A_log, dt_bias in fp32
    (as the official files keep the small vectors; the loader accepts any float dtype)."""
    D = cfg.hidden_size
    I, Is = cfg.moe_inter, cfg.shared_inter
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    C, vd, nv = cfg.conv_dim, cfg.lin_v_heads * cfg.lin_v_dim, cfg.lin_v_heads
    mat = lambda x: _np(x, dtype)
    vec = lambda x: _np(x, np.float32)
    out = {prefix + "embed_tokens.weight": mat(params["embed"]), prefix + "norm.weight": vec(params["final_norm"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = mat(params["lm_head"])
    for i, (lp, lt) in enumerate(zip(params["layers"], cfg.layer_types)):
        b = f"{prefix}layers.{i}."
        out[b + "input_layernorm.weight"] = vec(lp["in_norm"])
        out[b + "post_attention_layernorm.weight"] = vec(lp["post_norm"])
        m = lp["moe"]
        out[b + "mlp.gate.weight"] = mat(m["router"])
        out[b + "mlp.experts.gate_up_proj"] = mat(m["gate_up"])
        out[b + "mlp.experts.down_proj"] = mat(m["down"])
        sgu = np.asarray(m["shared_gate_up"], np.float32)
        out[b + "mlp.shared_expert.gate_proj.weight"] = mat(sgu[:Is])
        out[b + "mlp.shared_expert.up_proj.weight"] = mat(sgu[Is:2 * Is])
        out[b + "mlp.shared_expert.down_proj.weight"] = mat(m["shared_down"])
        out[b + "mlp.shared_expert_gate.weight"] = mat(m["shared_gate"])
        if lt == FULL:
            a = lp["attn"]
            qkv = np.asarray(a["qkv"], np.float32)
            qr = 2 * H * hd
            out[b + "self_attn.q_proj.weight"] = mat(qkv[:qr])
            out[b + "self_attn.k_proj.weight"] = mat(qkv[qr:qr + Hkv * hd])
            out[b + "self_attn.v_proj.weight"] = mat(qkv[qr + Hkv * hd:qr + 2 * Hkv * hd])
            out[b + "self_attn.o_proj.weight"] = mat(a["o"])
            out[b + "self_attn.q_norm.weight"] = vec(a["q_norm"])
            out[b + "self_attn.k_norm.weight"] = vec(a["k_norm"])
        else:
            g = lp["gdn"]
            ip = np.asarray(g["in_proj"], np.float32)
            out[b + "linear_attn.in_proj_qkv.weight"] = mat(ip[:C])
            out[b + "linear_attn.in_proj_z.weight"] = mat(ip[C:C + vd])
            out[b + "linear_attn.in_proj_b.weight"] = mat(ip[C + vd:C + vd + nv])
            out[b + "linear_attn.in_proj_a.weight"] = mat(ip[C + vd + nv:C + vd + 2 * nv])
            out[b + "linear_attn.conv1d.weight"] = mat(np.asarray(g["conv"], np.float32)[:, None, :])
            out[b + "linear_attn.A_log"] = vec(g["A_log"])
            out[b + "linear_attn.dt_bias"] = vec(g["dt_bias"])
            out[b + "linear_attn.norm.weight"] = vec(g["norm"])
            out[b + "linear_attn.out_proj.weight"] = mat(g["out"])
    return out


def hf_config_dict(cfg: Config, dtype: str = "bfloat16", **extra) -> dict:
    """A transformers ``Qwen3_5MoeTextConfig`` dict (model_type ``qwen3_5_moe_text``) for cfg."""
    d = {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "layer_types": list(cfg.layer_types),
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta),
                            "partial_rotary_factor": float(cfg.partial_rotary_factor)},
        "linear_conv_kernel_dim": cfg.conv_kernel,
        "linear_key_head_dim": cfg.lin_k_dim,
        "linear_value_head_dim": cfg.lin_v_dim,
        "linear_num_key_heads": cfg.lin_k_heads,
        "linear_num_value_heads": cfg.lin_v_heads,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.moe_inter,
        "shared_expert_intermediate_size": cfg.shared_inter,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "rms_norm_eps": cfg.rms_eps,
        "max_position_embeddings": cfg.max_context,
        "initializer_range": 0.02,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": dtype,
    }
    d.update(extra)
    return d


# ----------------------------------------------------------------------------- byte-level tokenizer

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer/decoder use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer():
    """A `tokenizers.Tokenizer` with 256 tokens, id = byte value, that decodes back to the bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_byte_tokenizer(out_dir: str) -> str:
    path = os.path.join(out_dir, "tokenizer.json")
    byte_tokenizer().save(path)
    return path


# ----------------------------------------------------------------------------- the directory

def write_checkpoint(params, cfg: Config, out_dir: str, *, dtype: str = "bfloat16", tokenizer: str | None = "bytes",
                     metadata: dict | None = None, config_extra: dict | None = None) -> str:
    """config.json + model.safetensors (+ tokenizer.json when tokenizer == "bytes") in out_dir."""
    from safetensors.numpy import save_file

    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    os.makedirs(out_dir, exist_ok=True)
    tensors = params_to_hf(params, cfg, np_dtype)
    meta = {"format": "pt"}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    st = os.path.join(out_dir, "model.safetensors")
    save_file({k: tensors[k] for k in sorted(tensors)}, st, metadata=meta)
    os.chmod(st, 0o644)  # safetensors writes 0600
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf_config_dict(cfg, dtype, **(config_extra or {})), fh, indent=2)
        fh.write("\n")
    if tokenizer == "bytes":
        if cfg.vocab_size != 256:
            raise ValueError(f"a byte tokenizer needs vocab_size 256, the config has {cfg.vocab_size}")
        write_byte_tokenizer(out_dir)
    return out_dir
