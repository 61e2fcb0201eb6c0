#!/usr/bin/env python3
"""Train the embedded default model: a small Qwen3.5-MoE (`qwen3_5_moe_text`) on Python source, byte level.

Data: every ``*.py`` under the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, recursively, ``site-packages`` /
``dist-packages`` / ``__pycache__`` skipped, sorted by relative path), files
joined by a NUL byte. A file is held out for validation when the first 8 hex
digits of sha256(relative path) are 0 mod ``--heldout-mod`` (50: about 2%).
Held-out bits per byte are reported next to ``xz -9`` and ``gzip -9`` on the
same held-out bytes (the concatenated held-out stream).

Model: both layer types (Gated DeltaNet and gated attention, 3:1), GQA, nv/nk = 2,
16 routed experts top 2 plus the gated shared expert, vocabulary 256 (bytes);
trained with ``baro_jax.train_model.forward_train`` (the same function as the
inference forward; the chunked delta rule), bf16 matmuls on fp32 master
weights, AdamW, linear warm-up then cosine decay sized from the wall-clock
budget, plus the Switch/Qwen load-balancing loss.

Writes into ``--out``: ``checkpoint/`` (config.json, model.safetensors in bf16 with
the official Qwen3.5 names, tokenizer.json), ``train_log.json`` and ``train_tiny.png``.
``--install`` also copies the checkpoint to ``baro_jax/checkpoints/tiny/``.

    python benchmarks/train_tiny.py --minutes 6 --out /tmp/tiny            # GPU (the shipped model)
    python benchmarks/train_tiny.py --smoke --minutes 0.5 --out /tmp/smoke  # CPU, whole pipeline, small
    python benchmarks/train_tiny.py --preset cpu --minutes 20 --out /tmp/cpu
    python benchmarks/train_tiny.py --eval-checkpoint baro_jax/checkpoints/tiny --out /tmp/ev  # held-out bpb only
    python benchmarks/train_tiny.py --time-blocks --out /tmp/tb   # fwd+bwd ms per block at the training shape

Held-out bits/byte are scored over windows of --seq bytes with stride seq/2 (every byte once; each byte
after the first window sees >= seq/2 bytes of context). Before this change (the run that produced the
shipped checkpoint's train_summary.json) the windows did not overlap, which gives slightly higher numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import lzma
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from baro_jax.config import Config, default_layer_types  # noqa: E402
from baro_jax import train_model as TM  # noqa: E402

SEP = b"\x00"

# Model and run presets. All: both layer types 3:1, GQA 2, nv/nk 2, 16 experts top 2 + shared, V 256.
MODELS = {
    # ~7.5M parameters, ~15 MB in bf16: the GPU (H200) run.
    "h200": dict(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=64, partial_rotary_factor=0.25,
                 lin_k_heads=2, lin_v_heads=4, lin_k_dim=64, lin_v_dim=64, num_experts=16, top_k=2,
                 moe_inter=48, shared_inter=128),
    # ~1.2M parameters: what 2 CPU cores can train in ~20 minutes.
    "cpu": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, partial_rotary_factor=0.25,
                lin_k_heads=2, lin_v_heads=4, lin_k_dim=32, lin_v_dim=32, num_experts=16, top_k=2,
                moe_inter=32, shared_inter=64),
    # a few hundred thousand parameters: the smoke test of the pipeline.
    "smoke": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, partial_rotary_factor=0.5,
                  lin_k_heads=2, lin_v_heads=4, lin_k_dim=16, lin_v_dim=16, num_experts=16, top_k=2,
                  moe_inter=16, shared_inter=32),
}
RUNS = {
    "h200": dict(batch=64, seq=1024, lr=3e-3, warmup=150, log_every=25, eval_every_s=30.0, eval_bytes=0, chunk=64,
                 dtype="bfloat16"),
    "cpu": dict(batch=8, seq=1024, lr=3e-3, warmup=100, log_every=10, eval_every_s=120.0, eval_bytes=0, chunk=64,
                dtype="float32"),
    "smoke": dict(batch=4, seq=128, lr=3e-3, warmup=10, log_every=5, eval_every_s=10.0, eval_bytes=16384, chunk=32,
                  dtype="float32"),
}


def log(msg: str) -> None:
    print(f"[train_tiny {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- data

def stdlib_files(root: str) -> list[str]:
    """Relative paths of the *.py files under root, sorted, without site-/dist-packages and caches."""
    out = []
    for r, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        out += [os.path.relpath(os.path.join(r, f), root) for f in files if f.endswith(".py")]
    return sorted(p.replace(os.sep, "/") for p in out)


def is_heldout(rel: str, mod: int) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % mod == 0


def load_corpus(root: str, mod: int):
    files = stdlib_files(root)
    train, held = [], []
    for rel in files:
        with open(os.path.join(root, rel), "rb") as fh:
            (held if is_heldout(rel, mod) else train).append((rel, fh.read()))
    join = lambda parts: SEP.join(b for _, b in parts) + SEP
    return join(train), join(held), [r for r, _ in train], [r for r, _ in held]


def compressed_bpb(data: bytes) -> dict:
    """Bits per byte of xz -9 and gzip -9 on data (the command-line tools when present)."""
    out = {}
    for name, cmd, fallback in (("xz -9", ["xz", "-9", "-c"], lambda d: lzma.compress(d, preset=9)),
                                ("gzip -9", ["gzip", "-9", "-c", "-n"], lambda d: gzip.compress(d, 9, mtime=0))):
        try:
            n = len(subprocess.run(cmd, input=data, capture_output=True, check=True).stdout)
            how = "cli"
        except (OSError, subprocess.CalledProcessError):
            n = len(fallback(data))
            how = "python"
        out[name] = {"bytes": n, "bpb": 8.0 * n / len(data), "via": how}
    return out


# ----------------------------------------------------------------------------- training pieces

def build_config(model: dict, seq: int) -> Config:
    kw = dict(model)
    n = kw["num_layers"]
    return Config(model_type="qwen3_5_moe_text", vocab_size=256, layer_types=default_layer_types(n, 4),
                  rope_theta=10000.0, conv_kernel=4, max_context=max(8192, seq), **kw).validate()


def pick_attention(requested: str, cfg: Config, seq: int) -> str:
    """"auto" on a GPU: cuDNN flash attention when it compiles, runs and agrees with XLA's; else XLA."""
    if requested != "auto":
        return requested
    if jax.default_backend() != "gpu":
        return "xla"
    try:
        ks = jax.random.split(jax.random.key(1), 3)
        q = jax.random.normal(ks[0], (2, seq, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
        k = jax.random.normal(ks[1], (2, seq, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
        v = jax.random.normal(ks[2], (2, seq, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)

        def f(impl):
            def loss(q, k, v):
                o = jax.nn.dot_product_attention(q, k, v, scale=cfg.head_dim ** -0.5, is_causal=True, implementation=impl)
                return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(cfg.head_dim)))
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

        (l1, g1), (l2, g2) = f("cudnn"), f("xla")
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) /
                  max(1e-6, float(jnp.max(jnp.abs(b.astype(jnp.float32))))) for a, b in zip(g1, g2))
        if not abs(float(l1) - float(l2)) <= 2e-2 * max(1.0, abs(float(l2))) or not err < 5e-2:
            log(f"cuDNN attention disagrees with XLA (loss {float(l1)} vs {float(l2)}, grad err {err}): using XLA")
            return "xla"
        return "cudnn"
    except Exception as e:  # noqa: BLE001
        log(f"cuDNN attention unavailable ({type(e).__name__}: {str(e)[:200]}): using XLA attention")
        return "xla"


def decay_mask(params):
    """AdamW weight decay on the matrices except the embeddings; never on norms, A_log, dt_bias."""
    keep = TM.f32_leaf_mask(params)
    m = jax.tree.map(lambda k: not k, keep)
    m["embed"] = False
    return m


def make_fns(cfg: Config, args, data_len: int):
    import optax

    A = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    fwd = dict(cfg=cfg, dtype=A, chunk=args.chunk, attn=args.attn, remat=args.remat)
    tx = optax.chain(optax.clip_by_global_norm(args.clip), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8))
    B, T = args.batch, args.seq

    def loss_fn(params, x, y):
        logits, router = TM.forward_train(params, x, **fwd)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        ce = jnp.mean(lse - tgt)
        aux = TM.load_balance_loss(router, cfg.num_experts)
        return ce + args.aux_coef * aux, (ce, aux)

    def train_step(params, opt_state, data, key, lr):
        off = jax.random.randint(key, (B,), 0, data_len - T - 1)
        w = data[off[:, None] + jnp.arange(T + 1)[None, :]].astype(jnp.int32)
        (loss, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, w[:, :-1], w[:, 1:])
        gnorm = optax.global_norm(grads)
        upd, opt_state = tx.update(grads, opt_state, params)
        dm = decay_mask(params)
        params = jax.tree.map(lambda p, u, d: p - lr * (u + (args.wd * p if d else 0.0)), params, upd, dm)
        return params, opt_state, {"ce": ce, "aux": aux, "gnorm": gnorm}

    def eval_step(params, x, y, mask):  # with the matrices in bf16: the precision of the shipped checkpoint
        logits, router = TM.forward_train(params, x, **dict(fwd, dtype=jnp.bfloat16))
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        nats = jnp.sum((lse - tgt) * mask)
        m = mask.reshape(-1)
        usage = jnp.stack([jnp.sum(jax.nn.one_hot(idx, cfg.num_experts, dtype=jnp.float32).sum(1) * m[:, None], 0)
                           for _, idx in router])
        return nats, usage

    return tx, jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(eval_step)


def eval_windows(stream: bytes, T: int, limit: int = 0, stride: int | None = None):
    """Windows of T positions over the stream that score every byte exactly once. The input at a
    position is the previous byte (NUL before the first byte). Window k >= 1 starts at k*stride and
    scores only its last `stride` positions, so every scored byte after the first window sees at least
    T - stride bytes of context (stride = T: non-overlapping windows). Returns x, y, mask [n, T], bytes."""
    s = np.frombuffer(stream, np.uint8)
    if limit:
        s = s[:limit]
    n = len(s)
    S = stride or T
    prev = np.concatenate([np.frombuffer(SEP, np.uint8), s[:-1]])
    starts = [0]
    while starts[-1] + T < n:
        starts.append(starts[-1] + S)
    x = np.zeros((len(starts), T), np.int32)
    y = np.zeros((len(starts), T), np.int32)
    mask = np.zeros((len(starts), T), np.float32)
    for k, a in enumerate(starts):
        b = min(a + T, n)
        x[k, :b - a], y[k, :b - a] = prev[a:b], s[a:b]
        first = 0 if k == 0 else T - S
        mask[k, first:b - a] = 1.0
    assert int(mask.sum()) == n
    return x, y, mask, n


def evaluate(eval_step, params, windows, batch: int):
    x, y, mask, n = windows
    nats = 0.0
    usage = None
    for i in range(0, len(x), batch):
        xb, yb, mb = x[i:i + batch], y[i:i + batch], mask[i:i + batch]
        if len(xb) < batch:  # pad the last batch (masked out) to keep one compiled shape
            pad = batch - len(xb)
            xb, yb = np.pad(xb, ((0, pad), (0, 0))), np.pad(yb, ((0, pad), (0, 0)))
            mb = np.pad(mb, ((0, pad), (0, 0)))
        nt, us = eval_step(params, jnp.asarray(xb), jnp.asarray(yb), jnp.asarray(mb))
        nats += float(nt)
        usage = np.asarray(us) if usage is None else usage + np.asarray(us)
    return nats / math.log(2) / n, usage


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


# ----------------------------------------------------------------------------- plot

def plot(path: str, rec: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.1, 1]})
    curve = rec["curve"]
    tok = [c["tokens"] / 1e6 for c in curve]
    a0.plot(tok, [c["train_bpb"] for c in curve], lw=1, label="train (bits/byte)")
    ev = [c for c in curve if c.get("heldout_bpb") is not None]
    a0.plot([c["tokens"] / 1e6 for c in ev], [c["heldout_bpb"] for c in ev], "o-", ms=3,
            label=f"held-out (subset of {rec['eval_bytes_during_training'] / 1e3:.0f} KB)")
    a0.axhline(rec["baselines"]["xz -9"]["bpb"], color="k", ls="--", lw=1, label=f"xz -9 {rec['baselines']['xz -9']['bpb']:.3f}")
    a0.axhline(rec["baselines"]["gzip -9"]["bpb"], color="gray", ls=":", lw=1,
               label=f"gzip -9 {rec['baselines']['gzip -9']['bpb']:.3f}")
    a0.axhline(rec["heldout_bpb"], color="C2", ls="-.", lw=1, label=f"final held-out {rec['heldout_bpb']:.3f}")
    a0.set_xlabel("training tokens (M)")
    a0.set_ylabel("bits per byte")
    top = max(rec["baselines"]["gzip -9"]["bpb"] + 0.5, min(8.5, max(c["train_bpb"] for c in curve)))
    a0.set_ylim(min(1.0, rec["heldout_bpb"] - 0.2), top)
    a0.set_title(f"{rec['n_params'] / 1e6:.2f}M params, {rec['steps']} steps, {rec['train_seconds'] / 60:.1f} min")
    a0.grid(alpha=0.3)
    a0.legend(fontsize=8)
    u = np.asarray(rec["expert_usage"])
    im = a1.imshow(u, aspect="auto", cmap="viridis", vmin=0)
    a1.set_xlabel("routed expert")
    a1.set_ylabel("layer")
    a1.set_yticks(range(len(u)))
    a1.set_yticklabels([f"{i} {'attn' if t == 'full_attention' else 'gdn'}" for i, t in enumerate(rec["layer_types"])])
    a1.set_title(f"held-out routing share per layer (uniform = {1 / u.shape[1]:.3f})")
    fig.colorbar(im, ax=a1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=6.0, help="wall-clock training budget (compile included)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--preset", choices=sorted(MODELS), default=None,
                    help="model + run preset (default: h200 on a GPU, cpu otherwise; smoke with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, short context, small eval: the pipeline check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stdlib", default=None, help="source root (default: sysconfig stdlib)")
    ap.add_argument("--heldout-mod", type=int, default=50)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--final-lr-frac", type=float, default=0.05)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--chunk", type=int, help="delta-rule chunk length")
    ap.add_argument("--attn", default="auto", choices=["auto", "xla", "cudnn", "reference"])
    ap.add_argument("--remat", action="store_true", help="rematerialise each layer in the backward pass")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="matmul dtype in training (default: bfloat16 on a GPU preset, float32 on the CPU presets, "
                         "where XLA's bf16 dots are no faster); evaluation always uses bf16 matrices, as shipped")
    ap.add_argument("--log-every", type=int)
    ap.add_argument("--eval-every-s", type=float)
    ap.add_argument("--eval-bytes", type=int, help="held-out bytes in the final eval (0: all)")
    ap.add_argument("--model", default=None, help="JSON overrides of the model preset, e.g. '{\"hidden_size\": 192}'")
    ap.add_argument("--eval-checkpoint", default=None, metavar="DIR",
                    help="no training: held-out bits/byte of a checkpoint directory (with xz/gzip baselines)")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the round trip through baro_jax.load and the sample after export (saves ~20 s)")
    ap.add_argument("--time-blocks", action="store_true",
                    help="no training: time forward + backward of each block at the training shape, then exit")
    ap.add_argument("--install", action="store_true", help="copy the checkpoint to baro_jax/checkpoints/tiny/")
    return ap.parse_args(argv)


def eval_checkpoint(args, final_eval: bytes, baselines: dict, held_files: list, root: str) -> dict:
    from baro_jax.config import load_config
    from baro_jax.weights import load_params

    cfg = load_config(args.eval_checkpoint)
    params = load_params(args.eval_checkpoint, cfg, dtype=jnp.float32, progress=False)
    args.attn = pick_attention(args.attn, cfg, args.seq)
    _, _, eval_step = make_fns(cfg, args, args.seq + 2)
    t = time.time()
    bpb, usage = evaluate(eval_step, params, eval_windows(final_eval, args.seq, 0, args.seq // 2), max(1, min(args.batch, 64)))
    share = usage / usage.sum(axis=1, keepdims=True)
    rec = {"checkpoint": os.path.abspath(args.eval_checkpoint), "heldout_bpb": bpb, "heldout_bytes": len(final_eval),
           "heldout_files": held_files, "stdlib": root, "python": sys.version.split()[0], "context": args.seq,
           "baselines": baselines, "expert_usage": share.tolist(), "seconds": time.time() - t}
    with open(os.path.join(args.out, "eval_checkpoint.json"), "w") as fh:
        json.dump(rec, fh, indent=1)
    log(f"{args.eval_checkpoint}: held-out {bpb:.4f} bits/byte over {len(final_eval)} bytes; "
        f"xz -9 {baselines['xz -9']['bpb']:.4f}, gzip -9 {baselines['gzip -9']['bpb']:.4f} ({time.time() - t:.1f}s)")
    return rec


def time_blocks(cfg: Config, args) -> dict:
    """Forward + backward time of each block at the training shape (where a step's time goes)."""
    A = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    B, T, D = args.batch, args.seq, cfg.hidden_size
    params = jax.jit(TM.init_params, static_argnums=0)(cfg, jax.random.key(0))
    p = TM.cast_params(params, A)
    gdn = next(lp for lp in p["layers"] if "gdn" in lp)
    att = next(lp for lp in p["layers"] if "attn" in lp)
    h = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32).astype(A)
    cos, sin = TM.rope_tables(cfg, T)
    nv, dk, dv = cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    ks = jax.random.split(jax.random.key(2), 5)
    qd = jax.random.normal(ks[0], (B, T, nv, dk)) * dk ** -0.5
    kd = jax.random.normal(ks[1], (B, T, nv, dk)) * dk ** -0.5
    vd = jax.random.normal(ks[2], (B, T, nv, dv))
    bd = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, nv)))
    gd = -jax.nn.softplus(jax.random.normal(ks[4], (B, T, nv)))
    tok = jax.random.randint(jax.random.key(3), (B, T), 0, 256)
    blocks = {
        "gdn mixer (1 layer)": (lambda w, x: TM._gdn(x, w, cfg, A, args.chunk).sum(), gdn["gdn"], h),
        "  chunked delta only": (lambda w, x: TM.chunked_delta(*x, args.chunk)[0].sum(), None, (qd, kd, vd, bd, gd)),
        "attention mixer (1 layer)": (lambda w, x: TM._attention(x, w, cfg, cos, sin, A, args.attn).sum(), att["attn"], h),
        "moe (1 layer)": (lambda w, x: TM._moe(x.reshape(B * T, D), w, cfg, A)[0].sum(), gdn["moe"], h),
        "whole forward + loss": (lambda w, x: TM.forward_train(w, x, cfg=cfg, dtype=A, chunk=args.chunk,
                                                               attn=args.attn)[0].mean(), params, tok),
    }
    out = {}
    for name, (f, w, x) in blocks.items():
        argn = 1 if w is None else 0
        g = jax.jit(jax.value_and_grad(f, argnums=argn))
        jax.block_until_ready(g(w, x))
        t = time.time()
        for _ in range(5):
            r = g(w, x)
        jax.block_until_ready(r)
        out[name] = (time.time() - t) / 5 * 1e3
        log(f"{name:28s} fwd+bwd {out[name]:8.2f} ms")
    return out


def main(argv=None):
    args = parse_args(argv)
    t_script = time.time()
    backend = jax.default_backend()
    preset = args.preset or ("smoke" if args.smoke else ("h200" if backend == "gpu" else "cpu"))
    for k, v in RUNS[preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    model = dict(MODELS[preset])
    if args.model:
        model.update(json.loads(args.model))
    cfg = build_config(model, args.seq)
    os.makedirs(args.out, exist_ok=True)
    log(f"jax {jax.__version__} on {backend} ({jax.devices()[0].device_kind}); preset {preset}")
    if args.time_blocks:
        args.attn = pick_attention(args.attn, cfg, args.seq)
        return time_blocks(cfg, args)

    root = args.stdlib or sysconfig.get_paths()["stdlib"]
    train_bytes, held_bytes, train_files, held_files = load_corpus(root, args.heldout_mod)
    log(f"data: {root}: {len(train_files)} train files {len(train_bytes) / 1e6:.2f} MB, "
        f"{len(held_files)} held-out files {len(held_bytes) / 1e6:.3f} MB")
    final_eval = held_bytes[:args.eval_bytes] if args.eval_bytes else held_bytes
    baselines = compressed_bpb(final_eval)
    log("baselines on the held-out bytes: " + ", ".join(f"{k} {v['bpb']:.4f} bpb" for k, v in baselines.items()))

    if args.eval_checkpoint:
        return eval_checkpoint(args, final_eval, baselines, held_files, root)

    key = jax.random.key(args.seed)
    params = jax.jit(TM.init_params, static_argnums=0)(cfg, jax.random.fold_in(key, 0))
    n_params = TM.count_params(params) - (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)
    log(f"model: {n_params / 1e6:.3f}M params ({2 * n_params / 1e6:.1f} MB in bf16), layers {cfg.layer_types}, "
        f"D {cfg.hidden_size}, E {cfg.num_experts} top {cfg.top_k}, I {cfg.moe_inter}, shared {cfg.shared_inter}; "
        f"batch {args.batch} x {args.seq}")
    args.attn = pick_attention(args.attn, cfg, args.seq)
    log(f"attention: {args.attn}; delta-rule chunk {args.chunk}; matmuls in {args.dtype}")
    data = jnp.asarray(np.frombuffer(train_bytes, np.uint8))
    tx, train_step, eval_step = make_fns(cfg, args, len(train_bytes))
    opt_state = tx.init(params)
    eval_batch = max(1, min(args.batch, 64))
    stride = args.seq // 2  # every scored byte after the first window has >= seq/2 bytes of context
    mid_windows = eval_windows(held_bytes, args.seq, min(len(held_bytes), 262144 if backend == "gpu" else 32768), stride)
    fin_windows = eval_windows(final_eval, args.seq, 0, stride)

    budget = args.minutes * 60.0
    t0 = time.time()
    deadline = t0 + budget
    total = None  # steps, estimated after a short calibration
    step = 0
    tokens_per_step = args.batch * args.seq
    curve = []
    pending = []
    t_cal = None
    s_cal = 0
    last_eval = t0
    eval_time = 0.0
    compile_s = None
    while True:
        lr = lr_at(step, total or 10 ** 9, args.lr, args.warmup, args.final_lr_frac)
        params, opt_state, met = train_step(params, opt_state, data, jax.random.fold_in(key, step + 1),
                                            jnp.float32(lr))
        pending.append(met)
        step += 1
        if step == 1:
            jax.block_until_ready(met)
            compile_s = time.time() - t0
            log(f"first step (compile) {compile_s:.1f}s")
        if step == 3:
            jax.block_until_ready(met)
            t_cal, s_cal = time.time(), step
        if step % args.log_every == 0 or (total is not None and step >= total) or time.time() >= deadline:
            vals = jax.device_get(pending)
            pending = []
            now = time.time()
            ce = float(np.mean([v["ce"] for v in vals]))
            rec = {"step": step, "tokens": step * tokens_per_step, "time_s": round(now - t0, 2),
                   "lr": lr, "train_loss": ce, "train_bpb": ce / math.log(2),
                   "aux": float(np.mean([v["aux"] for v in vals])), "gnorm": float(np.mean([v["gnorm"] for v in vals]))}
            if t_cal is not None and step > s_cal:
                rate = (step - s_cal) / (now - t_cal)  # steps/s, evals included
                total = max(step + 1, int(step + rate * (deadline - now)))
            if now - last_eval >= args.eval_every_s or (total is not None and step >= total) or now >= deadline:
                te = time.time()
                rec["heldout_bpb"], _ = evaluate(eval_step, params, mid_windows, eval_batch)
                eval_time += time.time() - te
                last_eval = time.time()
            curve.append(rec)
            log(f"step {step}/{total or '?'} tok {rec['tokens'] / 1e6:.1f}M loss {ce:.4f} ({rec['train_bpb']:.3f} bpb) "
                f"aux {rec['aux']:.3f} gnorm {rec['gnorm']:.2f} lr {lr:.2e} "
                + (f"held-out {rec['heldout_bpb']:.3f} " if "heldout_bpb" in rec else "")
                + (f"{(step - s_cal) * tokens_per_step / (now - t_cal) / 1e3:.0f}k tok/s" if t_cal and step > s_cal else ""))
            if now >= deadline or (total is not None and step >= total):
                break
    jax.block_until_ready(params)
    train_s = time.time() - t0
    log(f"training done: {step} steps, {step * tokens_per_step / 1e6:.1f}M tokens in {train_s:.1f}s")
    try:
        ms = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in ms:
            log(f"device memory: peak {ms['peak_bytes_in_use'] / 2 ** 30:.1f} GiB")
    except Exception:  # noqa: BLE001
        pass

    te = time.time()
    bpb, usage = evaluate(eval_step, params, fin_windows, eval_batch)
    final_eval_s = time.time() - te
    share = usage / usage.sum(axis=1, keepdims=True)
    log(f"held-out: {bpb:.4f} bits/byte over {len(final_eval)} bytes ({final_eval_s:.1f}s); "
        f"xz -9 {baselines['xz -9']['bpb']:.4f}, gzip -9 {baselines['gzip -9']['bpb']:.4f}")
    log("expert share per layer (min/max): " + ", ".join(f"{s.min():.3f}/{s.max():.3f}" for s in share))

    from baro_jax.export import write_checkpoint

    ck = os.path.join(args.out, "checkpoint")
    write_checkpoint(jax.device_get(params), cfg, ck, dtype="bfloat16",
                     metadata={"trained_by": "benchmarks/train_tiny.py", "heldout_bpb": f"{bpb:.4f}"},
                     config_extra={"router_aux_loss_coef": args.aux_coef})
    ck_bytes = os.path.getsize(os.path.join(ck, "model.safetensors"))
    summary = {"trained_by": "benchmarks/train_tiny.py", "argv": sys.argv[1:], "preset": preset,
               "device": jax.devices()[0].device_kind, "backend": backend, "jax": jax.__version__,
               "python": sys.version.split()[0], "n_params": n_params, "steps": step,
               "tokens": step * tokens_per_step, "batch": args.batch, "context": args.seq,
               "train_seconds": round(time.time() - t0, 1),
               "data": f"*.py of the Python {sys.version.split()[0]} stdlib, bytes, NUL between files; held out: "
                       f"int(sha256(relpath)[:8], 16) % {args.heldout_mod} == 0 ({len(held_files)} files)",
               "heldout_bytes": len(final_eval), "heldout_bpb": round(bpb, 4),
               "xz9_bpb": round(baselines["xz -9"]["bpb"], 4), "gzip9_bpb": round(baselines["gzip -9"]["bpb"], 4)}
    with open(os.path.join(ck, "train_summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
        fh.write("\n")
    log(f"checkpoint: {ck} ({ck_bytes / 1e6:.2f} MB)")

    # The shipped file through baro_jax's own loader and inference forward, on the first held-out window.
    check = {}
    try:
        if args.no_check:
            raise RuntimeError("skipped (--no-check)")
        import baro_jax

        eng = baro_jax.load(ck, backend="xla", dtype="bfloat16", progress=False)
        x, y, m, _ = fin_windows
        n_chk = int(min(args.seq, m[0].sum(), 512))
        lg = eng.prompt_logits([int(t) for t in x[0, :n_chk]])
        nll = jax.nn.logsumexp(lg, -1) - lg[np.arange(n_chk), y[0, :n_chk]]
        tl, _ = TM.forward_train(params, jnp.asarray(x[:1, :n_chk]), cfg=cfg, dtype=jnp.bfloat16, chunk=args.chunk)
        tl = np.asarray(tl[0])
        nll_t = jax.nn.logsumexp(tl, -1) - tl[np.arange(n_chk), y[0, :n_chk]]
        check = {"tokens": n_chk, "engine_bpb": float(np.mean(nll)) / math.log(2),
                 "train_forward_bpb": float(np.mean(nll_t)) / math.log(2),
                 "max_abs_logit_diff": float(np.max(np.abs(lg - tl)))}
        log(f"round trip (baro_jax.load of the bf16 file vs training forward, {n_chk} tokens): "
            f"{check['engine_bpb']:.4f} vs {check['train_forward_bpb']:.4f} bpb, max |dlogit| {check['max_abs_logit_diff']:.3g}")
        sample = eng.generate("def ", max_new_tokens=64, prefill="batch")
        check["sample"] = "def " + sample.text
        log("sample: " + repr(check["sample"]))
    except Exception as e:  # noqa: BLE001  (report, do not lose the run)
        check = {"error": f"{type(e).__name__}: {e}"}
        log(f"round-trip check failed: {check['error']}")

    rec = {
        "model_type": "qwen3_5_moe_text", "preset": preset, "config": dataclasses.asdict(cfg),
        "layer_types": list(cfg.layer_types), "n_params": n_params, "checkpoint_bytes": ck_bytes,
        "args": vars(args), "jax": jax.__version__, "backend": backend, "device": jax.devices()[0].device_kind,
        "python": sys.version.split()[0], "stdlib": root,
        "data": {"train_files": len(train_files), "train_bytes": len(train_bytes), "heldout_files": held_files,
                 "heldout_bytes_total": len(held_bytes), "separator": "NUL between files",
                 "heldout_rule": f"int(sha256(relpath)[:8], 16) % {args.heldout_mod} == 0"},
        "heldout_bpb": bpb, "heldout_bytes": len(final_eval), "baselines": baselines,
        "eval_bytes_during_training": int(mid_windows[3]),
        "expert_usage": share.tolist(), "expert_counts": usage.tolist(),
        "steps": step, "tokens": step * tokens_per_step, "train_seconds": train_s, "compile_seconds": compile_s,
        "eval_seconds_during_training": eval_time, "final_eval_seconds": final_eval_s,
        "tokens_per_second": step * tokens_per_step / train_s, "curve": curve, "roundtrip": check,
        "total_seconds": time.time() - t_script,
    }
    with open(os.path.join(args.out, "train_log.json"), "w") as fh:
        json.dump(rec, fh, indent=1)
    try:
        plot(os.path.join(args.out, "train_tiny.png"), rec)
    except Exception as e:  # noqa: BLE001
        log(f"plot failed: {type(e).__name__}: {e}")
    if args.install:
        dst = os.path.join(REPO, "baro_jax", "checkpoints", "tiny")
        os.makedirs(dst, exist_ok=True)
        for f in os.listdir(ck):
            shutil.copy2(os.path.join(ck, f), os.path.join(dst, f))
        log(f"installed into {dst}")
    log(f"done in {time.time() - t_script:.1f}s: held-out {bpb:.4f} bpb vs xz -9 {baselines['xz -9']['bpb']:.4f} "
        f"vs gzip -9 {baselines['gzip -9']['bpb']:.4f}")
    return rec


if __name__ == "__main__":
    main()
