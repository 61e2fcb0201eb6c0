"""baro_jax (xla backend, float32) against transformers (float32, eager attention, eager experts).

For each tiny random config: transformers builds the model (weights re-drawn at larger
scales, see hf_util), save_pretrained writes it, baro_jax loads the directory. Then
  * logits of every position of an 80-token prompt (> 64: several chunks of transformers'
    chunked delta rule) agree within  max|diff| <= TOL * max(1, max|logit|),  TOL = 1e-4;
  * 32 greedy tokens equal transformers' own greedy generate (do_sample=False).

Measured when written (CPU, jax 0.10.2, torch 2.13, transformers 5.24), max|diff| / bound:
next-base 6.0e-4 / 1.8e-3, next-wide 1.7e-3 / 4.2e-3, q35-vl-base 2.3e-4 / 1.5e-3,
q35-text-wide 3.4e-4 / 1.6e-3; mean |diff| ~1e-5. That is float32 noise of these models:
transformers' own two paths (chunked delta rule over the prompt vs. token-by-token
recurrent decode with its cache) disagree by up to 3.0e-3 (next-wide) / 3.5e-4
(q35-text-wide), and baro_jax's sequential scan is closer to transformers' recurrent path
than to its chunked one. Greedy: 32/32 tokens equal in all four cases (smallest top-1 vs
top-2 gap along transformers' greedy path: 0.023).
"""
import numpy as np
import pytest
import torch

import hf_util

import baro_jax

TOL = 1e-4
PROMPT_LEN = 80
NEW_TOKENS = 32

FULL, LIN = "full_attention", "linear_attention"

CASES = {
    # base shapes: D 64, 4 layers (3 GDN + 1 attention), H 4 / Hkv 2, hd 32, rotary 8 of 32, nk 2 / nv 4,
    # dk = dv = 16, 8 experts top 2, V 256
    "next-base": ("qwen3_next", 11, dict()),
    # GQA 3, hd 16 with rotary 8 (factor 0.5), nk 3 / nv 6 with dk 8 != dv 16, 16 experts top 4, Is != I,
    # attention first, odd vocab, tied embeddings
    "next-wide": ("qwen3_next", 12, dict(
        vocab_size=300, hidden_size=48, num_hidden_layers=5, layer_types=[FULL, LIN, LIN, FULL, LIN],
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, rope_theta=1e6,
        linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=16,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        tie_word_embeddings=True)),
    # Qwen3.5 multimodal class (nested text_config, prefix model.language_model., tiny vision tower)
    "q35-vl-base": ("qwen3_5_moe", 13, dict()),
    # Qwen3.5 text-only class: GQA 4, full rotary (factor 1.0), 6 layers, 2 attention layers
    "q35-text-wide": ("qwen3_5_moe_text", 14, dict(
        hidden_size=96, num_hidden_layers=6, layer_types=[LIN, FULL, LIN, LIN, LIN, FULL],
        num_attention_heads=8, num_key_value_heads=2, head_dim=24, partial_rotary_factor=1.0, rope_theta=1e7,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=24, linear_value_head_dim=16,
        num_experts=12, num_experts_per_tok=3, moe_intermediate_size=40, shared_expert_intermediate_size=24)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity(case, tmp_path):
    arch, seed, overrides = CASES[case]
    model = hf_util.build(arch, seed=seed, **overrides)
    V = hf_util.text_config(model.config).vocab_size
    path = hf_util.save(model, str(tmp_path / case))
    ids = torch.randint(0, V, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))

    with torch.no_grad():
        ref = model(ids).logits[0].float().numpy()
        # an explicit all-ones mask: without one, generate masks every prompt token equal to pad_token_id
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    ref_tokens = gen.sequences[0, PROMPT_LEN:].tolist()
    # how decisive transformers' own greedy choices are (top-1 minus top-2 logit)
    gaps = [float(np.diff(np.sort(s[0].float().numpy())[-2:])[0]) for s in gen.scores]

    eng = baro_jax.load(path, backend="xla", dtype="float32", progress=False)
    got = eng.prompt_logits(ids[0].tolist())
    assert got.shape == ref.shape and got.dtype == np.float32
    diff = float(np.max(np.abs(got - ref)))
    scale = max(1.0, float(np.max(np.abs(ref))))
    print(f"\n[{case}] logits: max|diff| {diff:.3g}, max|logit| {scale:.3g}, bound {TOL * scale:.3g}, "
          f"logit std {np.std(ref):.3g}; argmax agree {np.mean(got.argmax(-1) == ref.argmax(-1)):.3f}; "
          f"min greedy gap {min(gaps):.3g}")
    assert diff <= TOL * scale, f"{case}: max|diff| {diff} > {TOL} * {scale}"

    res = eng.generate(ids[0].tolist(), max_new_tokens=NEW_TOKENS, prefill="replay", stop_at_eos=False)
    assert len(res.generated_ids) == NEW_TOKENS
    assert res.generated_ids == ref_tokens, (
        f"{case}: greedy tokens differ at {next(i for i, (a, b) in enumerate(zip(res.generated_ids, ref_tokens)) if a != b)}"
        f"\n ours {res.generated_ids}\n hf   {ref_tokens}")
