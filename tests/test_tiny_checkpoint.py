"""The shipped default model, baro_jax/checkpoints/tiny: a trained qwen3_5_moe_text checkpoint.

It must be the architecture (both layer types, GQA, nv/nk 2, >= 16 experts top >= 2 plus the
shared expert, bytes), small, load with baro_jax's loader and with transformers, come with a
byte-level tokenizer.json, and agree with transformers: float32 logits over a > 64-token prompt
within 1e-4 * max(1, max|logit|), and the same greedy continuation.
"""
import json
import os

import numpy as np
import pytest

import baro_jax
from baro_jax.config import FULL, LINEAR, load_config

CKPT = os.path.join(os.path.dirname(baro_jax.__file__), "checkpoints", "tiny")
TOL = 1e-4
NEW_TOKENS = 24
PROMPT = (b"import os\n\n\ndef read_lines(path, encoding='utf-8'):\n"
          b"    \"\"\"Return the lines of a text file, without trailing newlines.\"\"\"\n"
          b"    with open(path, encoding=encoding) as f:\n        return [")


def test_files_and_size():
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(CKPT, f)), f
    size = os.path.getsize(os.path.join(CKPT, "model.safetensors"))
    assert size <= 16 * 2 ** 20, f"model.safetensors is {size} bytes"
    with open(os.path.join(CKPT, "model.safetensors"), "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    names = [k for k in header if k != "__metadata__"]
    assert all(k.startswith("model.language_model.") or k == "lm_head.weight" for k in names)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert {header[k]["dtype"] for k in names if header[k]["shape"].__len__() >= 2} == {"BF16"}


def test_config_is_the_architecture():
    with open(os.path.join(CKPT, "config.json")) as fh:
        raw = json.load(fh)
    assert raw["model_type"] == "qwen3_5_moe_text"
    rp = raw["rope_parameters"]
    assert "rope_theta" in rp and "partial_rotary_factor" in rp
    cfg = load_config(CKPT)
    n_full = cfg.layer_types.count(FULL)
    n_lin = cfg.layer_types.count(LINEAR)
    assert n_full >= 1 and n_lin >= 3 * n_full
    assert cfg.num_heads > cfg.num_kv_heads and cfg.num_heads % cfg.num_kv_heads == 0
    assert cfg.lin_v_heads == 2 * cfg.lin_k_heads
    assert cfg.num_experts >= 16 and cfg.top_k >= 2 and cfg.shared_inter > 0
    assert cfg.vocab_size == 256


def test_tokenizer_is_bytes():
    from tokenizers import Tokenizer

    from baro_jax.tokenizer import load_tokenizer

    tok = Tokenizer.from_file(os.path.join(CKPT, "tokenizer.json"))
    assert tok.get_vocab_size() == 256
    for text in ("héllo", "def f(x):\n\treturn x  # ünïcødé ✓\n", "\x00\x7f"):
        ids = tok.encode(text).ids
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    bt = load_tokenizer(CKPT)
    assert bt.encode("héllo") == list("héllo".encode()) and bt.decode(bt.encode("héllo")) == "héllo"


def test_baro_jax_and_transformers_agree():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        CKPT, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()

    eng = baro_jax.load(CKPT, backend="xla", dtype="float32", progress=False)
    ids = eng.encode(PROMPT.decode())
    assert ids == list(PROMPT) and len(ids) > 64
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = model(x).logits[0].float().numpy()
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    ref_tokens = gen[0, len(ids):].tolist()

    got = eng.prompt_logits(ids)
    scale = max(1.0, float(np.abs(ref).max()))
    diff = float(np.abs(got - ref).max())
    assert diff <= TOL * scale, f"max|diff| {diff} > {TOL} * {scale}"

    res = eng.generate(ids, max_new_tokens=NEW_TOKENS, prefill="batch", stop_at_eos=False)
    assert res.generated_ids == ref_tokens, (res.generated_ids, ref_tokens)


def test_it_is_trained():
    """A trained model, not random weights (~8 bits per byte): the shipped H200 model gives ~0.6 here."""
    import jax

    eng = baro_jax.load(CKPT, backend="xla", dtype="bfloat16", progress=False)
    text = (b"class Stack:\n    def __init__(self):\n        self.items = []\n\n"
            b"    def push(self, item):\n        self.items.append(item)\n\n"
            b"    def pop(self):\n        return self.items.pop()\n")
    ids = list(text)
    lg = eng.prompt_logits(ids)
    nll = jax.nn.logsumexp(lg[:-1], -1) - lg[np.arange(len(ids) - 1), ids[1:]]
    bpb = float(np.mean(nll)) / np.log(2)
    assert bpb < 1.5, bpb
