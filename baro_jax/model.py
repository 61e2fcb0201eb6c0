"""One functional forward over m consecutive tokens of one sequence.

Decode is m = 1, a prefill chunk is m = C: the same code and the same ops, so
with the `ordered` backend (row-invariant kernels) both give the same bits.
`cfg.layer_types` drives the weights, the state and the dispatch.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from .config import DELTA_BLOCK, FULL, Config

f32 = jnp.float32


def rope_tables(cfg: Config, length: int):
    """cos/sin [length, R/2] made once in float64 so every position is exact in fp32."""
    half = cfg.rotary_dim // 2
    inv = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rotary_dim)
    ang = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    return jnp.asarray(np.cos(ang), f32), jnp.asarray(np.sin(ang), f32)


def init_state(cfg: Config, dtype=jnp.bfloat16, length: int | None = None):
    """Zeroed per-layer state for a context of `length` tokens."""
    S = length or cfg.max_context
    layers = []
    for t in cfg.layer_types:
        if t == FULL:
            kv = (S, cfg.num_kv_heads, cfg.head_dim)
            layers.append({"k": jnp.zeros(kv, dtype), "v": jnp.zeros(kv, dtype)})
        else:
            st = {
                "conv": jnp.zeros((cfg.conv_kernel - 1, cfg.conv_dim), dtype),
                "ssm": jnp.zeros((cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), f32),
            }
            if cfg.delta_rule == "blocked":  # ssm is then S0, the state at the current block's start
                st.update(blocked_delta_state(cfg))
            layers.append(st)
    return tuple(layers)


def blocked_delta_shapes(cfg: Config):
    """Shapes (all fp32) of the pending rows of the current delta block (docs/DESIGN.md §9): per value
    head the normalised k_j, the u_j and the local prefix log-decays c_j of slots j < pos % B."""
    nv, B = cfg.lin_v_heads, DELTA_BLOCK
    return {"blk_k": (nv, B, cfg.lin_k_dim), "blk_u": (nv, B, cfg.lin_v_dim), "blk_c": (nv, B)}


def blocked_delta_state(cfg: Config):
    """The pending rows, zeroed (a block's empty slots hold +0)."""
    return {k: jnp.zeros(s, f32) for k, s in blocked_delta_shapes(cfg).items()}


def attention_block(h, p, st, cfg, ops, cos, sin, pos, n_valid):
    qkv = ops.matmul(h, p["qkv"])
    o, st = attention_core(qkv, p, st, cfg, ops, cos, sin, pos, n_valid)
    return ops.matmul(o, p["o"]), st


def attention_core(qkv, p, st, cfg, ops, cos, sin, pos, n_valid):
    o, k, v = ops.attention(qkv, p["q_norm"], p["k_norm"], cos, sin, st["k"], st["v"], pos, n_valid,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_eps)
    return o, {"k": k, "v": v}


def gdn_columns(cfg):
    """Where z, b and a start in the GDN's projection [mixed (C) | z (nv*dv) | b (nv) | a (nv)]."""
    C, nv = cfg.conv_dim, cfg.lin_v_heads
    return C, C + nv * cfg.lin_v_dim, C + nv * cfg.lin_v_dim + nv


def gdn_block(h, p, st, cfg, ops, pos, n_valid):
    # Every op reads its columns of the projection in place (conv the first C, in the state's
    # dtype; the others from a column offset), since a slice handed to a custom call is a copy.
    # packed: the backend returned the conv's columns already in bf16 (the bytes it rounds to).
    proj, packed = ops.gdn_projection(h, p["in_proj"], cfg.conv_dim)
    o, st = gdn_core(proj, p, st, cfg, ops, pos, n_valid, packed)
    g = ops.gated_norm(o, proj, p["norm"], cfg.rms_eps, h.dtype, z_col=gdn_columns(cfg)[0])
    return ops.matmul(g, p["out"]), st


def gdn_core(proj, p, st, cfg, ops, pos, n_valid, packed=False):
    """The GDN between its projections: the causal conv and the delta rule, (o, new state)."""
    nv = cfg.lin_v_heads
    _, b_col, a_col = gdn_columns(cfg)
    y, window = ops.conv(proj, p["conv"], st["conv"], n_valid, packed=packed)
    if cfg.delta_rule == "blocked":
        b, a = proj[:, b_col:b_col + nv], proj[:, a_col:]
        o, ssm, bk, bu, bc = ops.delta_blocked(y, b, a, p["A_log"], p["dt_bias"], st["ssm"], st["blk_k"],
                                               st["blk_u"], st["blk_c"], pos, n_valid,
                                               nk=cfg.lin_k_heads, dk=cfg.lin_k_dim)
        new = {"conv": window, "ssm": ssm, "blk_k": bk, "blk_u": bu, "blk_c": bc}
    else:
        o, ssm = ops.delta(y, proj, proj, p["A_log"], p["dt_bias"], st["ssm"], n_valid,
                           nk=cfg.lin_k_heads, dk=cfg.lin_k_dim, b_col=b_col, a_col=a_col)
        new = {"conv": window, "ssm": ssm}
    return o, new


def layer_mixer(x, h, lp, st, kind, cfg, ops, cos, sin, pos, n_valid):
    """The first half of a layer, from x and h = norm1(x): (x + mixer(h), norm2 of that (the
    MoE's input), new state)."""
    A = lp["moe"]["router"].dtype
    if kind == FULL:
        y, st = attention_block(h, lp["attn"], st, cfg, ops, cos, sin, pos, n_valid)
    else:
        y, st = gdn_block(h, lp["gdn"], st, cfg, ops, pos, n_valid)
    x, h2 = ops.add_rmsnorm(x, y, lp["post_norm"], cfg.rms_eps, A)  # x + y, and its norm
    return x, h2, st


def layer_forward(x, h, lp, st, kind, cfg, ops, cos, sin, pos, n_valid, next_norm):
    """x += mixer(h); x += moe(norm2(x)), from x and h = norm1(x); returns (x, next_norm(x),
    state): every residual add is fused with the norm after it (the next layer's norm1, or the
    final norm), one call instead of two. (Tier decode runs layer_mixer, then the MoE through
    its expert cache: staging.py.)"""
    x, h2, st = layer_mixer(x, h, lp, st, kind, cfg, ops, cos, sin, pos, n_valid)
    x, h = layer_moe(x, h2, lp["moe"], next_norm, cfg, ops)
    return x, h, st


def layer_moe(x, h2, m, next_norm, cfg, ops):
    """The second half of a layer: x + moe(h2) and next_norm of it, m the layer's MoE params."""
    y = ops.moe(h2, m["router"], m["gate_up"], m["down"], m["shared_gate_up"], m["shared_down"],
                m["shared_gate"], top_k=cfg.top_k)
    return ops.add_rmsnorm(x, y, next_norm, cfg.rms_eps, m["router"].dtype)


def first_norm(lp, x, cfg, ops):
    """norm1 of layer 0, lp its params (every later norm comes out of the residual add before it)."""
    return ops.rmsnorm(x, lp["in_norm"], cfg.rms_eps, lp["moe"]["router"].dtype)


def next_norms(params):
    """The norm after each layer's last residual add: the next layer's norm1, then the final norm."""
    layers = params["layers"]
    return tuple(lp["in_norm"] for lp in layers[1:]) + (params["final_norm"],)


def embed(params, tokens):
    return params["embed"][tokens].astype(f32)


def rope_rows(rope, pos, m):
    """cos/sin rows for positions pos..pos+m-1 (clipped: padded rows past the end are garbage anyway)."""
    cos, sin = rope
    idx = jnp.clip(pos + jnp.arange(m), 0, cos.shape[0] - 1)
    return cos[idx], sin[idx]


def prologue(params, tokens, pos, rope):
    """Embedded rows and their rope rows: what every layer of a forward over `tokens` takes."""
    x = embed(params, tokens)
    cos, sin = rope_rows(rope, pos, tokens.shape[0])
    return x, cos, sin


def epilogue(params, h, n_valid, *, cfg: Config, ops, all_logits: bool = False):
    """From the final-normed rows h: logits of the last valid row [V] fp32, or of every row
    [m, V] when all_logits."""
    if all_logits:
        return ops.matmul(h, params["lm_head"])
    last = jax.lax.dynamic_slice_in_dim(h, n_valid - 1, 1, axis=0)
    return ops.matmul(last, params["lm_head"])[0]


def forward(params, state, tokens, pos, n_valid, rope, *, cfg: Config, ops, all_logits: bool = False):
    """Run m tokens at positions pos.. through every layer.

    Returns (logits, new_state): logits of the last valid row [V] fp32, or of
    every row [m, V] when all_logits. Tier mode (staging.py) runs the same
    prologue, layer_forward and epilogue from a Python loop.
    """
    x, cos, sin = prologue(params, tokens, pos, rope)
    h = first_norm(params["layers"][0], x, cfg, ops)
    new_state = []
    for lp, st, kind, nn in zip(params["layers"], state, cfg.layer_types, next_norms(params)):
        x, h, st = layer_forward(x, h, lp, st, kind, cfg, ops, cos, sin, pos, n_valid, nn)
        new_state.append(st)
    return epilogue(params, h, n_valid, cfg=cfg, ops=ops, all_logits=all_logits), tuple(new_state)


# --- many sequences: one decode row per sequence slot ----------------------------------------------
# The pool holds every slot's state (pool.py): attention KV in pages [NP, page, Hkv, hd] mapped by
# one page table [P, S / page], the conv window [K-1, P, C] and the delta state [P, nv, dk, dv]. A
# decode step runs one row per slot. The GEMMs, norms and the MoE are row-invariant, so rows of
# many sequences share their calls. The conv and the delta rule treat channels and heads
# independently, so P rows of C channels (nv heads) run as ONE token of P*C channels (P*nv heads):
# the m = 1 kernels a sequence runs alone, on the same numbers. Their rows mode reads each row's
# channels and heads where they sit (the projection's row p, the pool's slot p) instead of a
# folded copy, which would cost a copy kernel per operand per layer and step. Attention reads each
# row's own slot through the table (ops.attention_rows).

def gdn_rows(h, p, pool, cfg, ops):
    """gdn_block for one decode row per slot: h [P, D]; pool {"conv": [K-1, P, C], "ssm": [P, nv, dk, dv]}."""
    proj = ops.matmul(h, p["in_proj"])
    o, pool = gdn_rows_core(proj, p, pool, cfg, ops)
    g = ops.gated_norm(o, proj, p["norm"], cfg.rms_eps, h.dtype, z_col=gdn_columns(cfg)[0])
    return ops.matmul(g, p["out"]), pool


def gdn_rows_core(proj, p, pool, cfg, ops):
    P, C, nv = proj.shape[0], cfg.conv_dim, cfg.lin_v_heads
    _, b_col, a_col = gdn_columns(cfg)
    K1 = pool["conv"].shape[0]
    y, window = ops.conv(proj, p["conv"], pool["conv"].reshape(K1, P * C), jnp.int32(1), rows=True)
    o, ssm = ops.delta(y, proj, proj, p["A_log"], p["dt_bias"], pool["ssm"].reshape((P * nv,) + pool["ssm"].shape[2:]),
                       jnp.int32(1), nk=cfg.lin_k_heads, dk=cfg.lin_k_dim, b_col=b_col, a_col=a_col, rows=True)
    return o, {"conv": window.reshape(K1, P, C), "ssm": ssm.reshape(pool["ssm"].shape)}


def attention_rows(h, p, pool, table, cfg, ops, cos, sin, slots, pos):
    qkv = ops.matmul(h, p["qkv"])
    o, pool = attention_rows_core(qkv, p, pool, table, cfg, ops, cos, sin, slots, pos)
    return ops.matmul(o, p["o"]), pool


def attention_rows_core(qkv, p, pool, table, cfg, ops, cos, sin, slots, pos):
    o, k, v = ops.attention_rows(qkv, p["q_norm"], p["k_norm"], cos, sin, pool["k"], pool["v"], table, slots, pos,
                                 num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_eps)
    return o, {"k": k, "v": v}


def rows_prologue(params, tokens, pos, rope):
    """Embedded rows and rope rows of one decode row per slot (row r at position pos[r])."""
    return embed(params, tokens), rope[0][pos], rope[1][pos]


def rows_mixer(x, h, lp, st, table, kind, cfg, ops, cos, sin, slots, pos):
    """layer_mixer for one decode row per slot, st the layer's pool, table the pool's page table:
    (x + mixer(h), norm2 of it, the layer's new pool). slots as decode_rows'."""
    if kind == FULL:
        y, st = attention_rows(h, lp["attn"], st, table, cfg, ops, cos, sin, slots, pos)
    else:
        y, st = gdn_rows(h, lp["gdn"], st, cfg, ops)
    x, h2 = ops.add_rmsnorm(x, y, lp["post_norm"], cfg.rms_eps, lp["moe"]["router"].dtype)
    return x, h2, st


def rows_head(params, h, ops):
    """Logits [P, V] fp32 of every row, from the final-normed rows h."""
    return ops.matmul(h, params["lm_head"])


def decode_rows(params, pool, table, tokens, slots, pos, rope, *, cfg: Config, ops):
    """One decode step for every slot of the pool (attention KV through the page table `table`):
    row r is slot r's token at position pos[r]; slots[r] is r for a running sequence and -1 for
    a slot with nothing to decode (its attention row writes and reads nothing; its conv and delta
    rows run on its state, which the caller keeps as it was). Returns (logits [P, V] fp32, new
    pool). Tier mode runs the same rows_prologue, rows_mixer and MoE from a Python loop
    (staging.decode_rows)."""
    x, cos, sin = rows_prologue(params, tokens, pos, rope)
    h = first_norm(params["layers"][0], x, cfg, ops)
    new_pool = []
    for lp, st, kind, nn in zip(params["layers"], pool, cfg.layer_types, next_norms(params)):
        x, h2, st = rows_mixer(x, h, lp, st, table, kind, cfg, ops, cos, sin, slots, pos)
        x, h = layer_moe(x, h2, lp["moe"], nn, cfg, ops)
        new_pool.append(st)
    return rows_head(params, h, ops), tuple(new_pool)


# --- a prefill chunk and the decode rows in one pass ----------------------------------------------
# Under mixed load a round runs a prefill chunk of one sequence and a decode step of the others.
# As two passes every weight is read twice; here the chunk's rows and the decode rows go through
# each GEMM, norm and the MoE together (those ops are row-invariant, so every row keeps the bits
# of its own pass) and only the mixers run apart: the chunk's on its one-sequence state, the
# rows' on the pool.

def mixed_forward(params, state, tokens, pos, n_valid, pool, table, row_tokens, slots, row_pos, rope, *,
                  cfg: Config, ops, all_logits: bool = False):
    """forward(params, state, tokens, pos, n_valid) and decode_rows(params, pool, table,
    row_tokens, slots, row_pos) in one pass. Returns (the chunk's logits as forward's, the rows'
    logits [P, V], the chunk's new state, the new pool)."""
    x, chunk, rows = mixed_prologue(params, tokens, pos, n_valid, row_tokens, slots, row_pos, rope)
    h = first_norm(params["layers"][0], x, cfg, ops)
    new_state, new_pool = [], []
    for lp, st, sub, kind, nn in zip(params["layers"], state, pool, cfg.layer_types, next_norms(params)):
        x, h2, st, sub = mixed_mixer(x, h, lp, st, sub, table, chunk, rows, kind, cfg, ops)
        x, h = layer_moe(x, h2, lp["moe"], nn, cfg, ops)
        new_state.append(st)
        new_pool.append(sub)
    return mixed_head(params, h, tokens.shape[0], n_valid, ops, all_logits) + (tuple(new_state), tuple(new_pool))


def mixed_prologue(params, tokens, pos, n_valid, row_tokens, slots, row_pos, rope):
    """The chunk's and the rows' embedded rows, concatenated, and what each part's mixers take:
    chunk = (cos, sin, pos, n_valid), rows = (cos, sin, slots, row_pos)."""
    x1, cos, sin = prologue(params, tokens, pos, rope)
    x2, rcos, rsin = rows_prologue(params, row_tokens, row_pos, rope)
    return jnp.concatenate([x1, x2]), (cos, sin, pos, n_valid), (rcos, rsin, slots, row_pos)


def mixed_mixer(x, h, lp, st, sub, table, chunk, rows, kind, cfg, ops):
    """layer_mixer over the chunk's rows (the first len(chunk cos), on the one-sequence state st)
    and rows_mixer over the decode rows (on the layer's pool sub), the projections shared:
    (x + mixer(h), norm2 of it, new st, new sub)."""
    C = chunk[0].shape[0]
    cos, sin, pos, n_valid = chunk
    rcos, rsin, slots, row_pos = rows
    if kind == FULL:
        p = lp["attn"]
        qkv = ops.matmul(h, p["qkv"])
        o1, st = attention_core(qkv[:C], p, st, cfg, ops, cos, sin, pos, n_valid)
        o2, sub = attention_rows_core(qkv[C:], p, sub, table, cfg, ops, rcos, rsin, slots, row_pos)
        y = ops.matmul(jnp.concatenate([o1, o2]), p["o"])
    else:
        p = lp["gdn"]
        proj = ops.matmul(h, p["in_proj"])
        o1, st = gdn_core(proj[:C], p, st, cfg, ops, pos, n_valid)
        o2, sub = gdn_rows_core(proj[C:], p, sub, cfg, ops)
        g = ops.gated_norm(jnp.concatenate([o1, o2]), proj, p["norm"], cfg.rms_eps, h.dtype, z_col=gdn_columns(cfg)[0])
        y = ops.matmul(g, p["out"])
    x, h2 = ops.add_rmsnorm(x, y, lp["post_norm"], cfg.rms_eps, lp["moe"]["router"].dtype)
    return x, h2, st, sub


def mixed_head(params, h, C: int, n_valid, ops, all_logits: bool):
    """(the chunk's logits as epilogue's, the decode rows' logits [P, V]) from the final-normed
    rows h, the chunk's C first: one lm_head product for both."""
    if all_logits:
        logits = rows_head(params, h, ops)
        return logits[:C], logits[C:]
    last = jax.lax.dynamic_slice_in_dim(h, n_valid - 1, 1, axis=0)
    logits = rows_head(params, jnp.concatenate([last, h[C:]]), ops)
    return logits[0], logits[1:]
