"""The `xla` backend: every op of docs/NUMERICS.md written plainly in jnp.

It is the numeric reference for the ordered kernels (same rounding points,
possibly different summation order) and the "fast but not identical" speed
arm. Differentiable, so the training script can use it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .pool import gather_cache

f32 = jnp.float32
KV_BLOCK = 64  # documented for the kernels; the reference attends to the whole cache at once


def matmul(x, w):
    """x[m,K] @ w[N,K]^T with fp32 accumulation -> fp32 [m,N]."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=f32)


def gdn_projection(h, w, conv_cols):
    """The GDN input projection and whether its conv columns are packed (never here)."""
    return matmul(h, w), False


def _rms_scale(x, eps):
    ss = jnp.sum(x * x, axis=-1, keepdims=True)
    return 1.0 / jnp.sqrt(ss / x.shape[-1] + eps)


def rmsnorm(x, w, eps, dtype=jnp.bfloat16):
    """Zero-centred RMSNorm: A((x * r) * (1 + w))."""
    x = x.astype(f32)
    return ((x * _rms_scale(x, eps)) * (1.0 + w.astype(f32))).astype(dtype)


def add_rmsnorm(x, y, w, eps, dtype=jnp.bfloat16):
    """(x + y, rmsnorm(x + y)): the residual add and the norm after it."""
    s = x + y
    return s, rmsnorm(s, w, eps, dtype)


def head_rmsnorm(x, w, eps):
    """Zero-centred RMSNorm over the last axis, fp32 out (q/k norms)."""
    return (x * _rms_scale(x, eps)) * (1.0 + w.astype(f32))


def gated_norm(o, z, w, eps, dtype=jnp.bfloat16, z_col=0):
    """o[m,nv,dv] fp32, z[m, W] fp32 (the gates at columns z_col .. z_col + nv*dv)
    -> A((o*r) * w * silu(gates)) [m, nv*dv]."""
    m, nv, dv = o.shape
    zz = z[:, z_col:z_col + nv * dv].reshape(m, nv, dv).astype(f32)
    y = (o * _rms_scale(o, eps)) * w.astype(f32) * jax.nn.silu(zz)
    return y.astype(dtype).reshape(m, nv * dv)


def rope(x, cos, sin):
    """Rotate-half rotary on the first 2*cos.shape[-1] dims of x[m, heads, hd]."""
    half = cos.shape[-1]
    a = x[..., :half]
    b = x[..., half:2 * half]
    c = cos[:, None, :]
    s = sin[:, None, :]
    return jnp.concatenate([a * c - b * s, b * c + a * s, x[..., 2 * half:]], axis=-1)


def _write_rows(cache, rows, pos, n_valid):
    """Write rows[i] to cache[pos+i] for i < n_valid; padded rows are dropped."""
    m = rows.shape[0]
    i = jnp.arange(m)
    idx = jnp.where(i < n_valid, pos + i, cache.shape[0])  # out of range -> dropped
    return cache.at[idx].set(rows.astype(cache.dtype), mode="drop")


def attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, n_valid, *, num_heads, num_kv_heads, eps):
    """Gated causal attention for rows at pos..pos+m-1 (see NUMERICS.md)."""
    m = qkv.shape[0]
    S, hkv, hd = k_cache.shape
    H = num_heads
    A = k_cache.dtype
    qg = qkv[:, : 2 * H * hd].reshape(m, H, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = qkv[:, 2 * H * hd: (2 * H + hkv) * hd].reshape(m, hkv, hd)
    v = qkv[:, (2 * H + hkv) * hd:].reshape(m, hkv, hd)
    q = rope(head_rmsnorm(q, q_norm, eps), cos, sin).astype(A)
    k = rope(head_rmsnorm(k, k_norm, eps), cos, sin).astype(A)
    k_cache = _write_rows(k_cache, k, pos, n_valid)
    v_cache = _write_rows(v_cache, v.astype(A), pos, n_valid)
    rep = H // hkv
    qh = q.reshape(m, hkv, rep, hd)
    s = jnp.einsum("mgrd,sgd->grms", qh, k_cache, preferred_element_type=f32) * f32(hd ** -0.5)
    qpos = pos + jnp.arange(m)
    mask = jnp.arange(S)[None, :] <= qpos[:, None]
    s = jnp.where(mask[None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    # Rows past the last query are never read (they may hold anything, even NaN).
    seen = (jnp.arange(S) < pos + m)[:, None, None]
    v_seen = jnp.where(seen, v_cache, jnp.zeros((), A))
    o = jnp.einsum("grms,sgd->mgrd", p.astype(A), v_seen, preferred_element_type=f32)
    o = o.reshape(m, H, hd) * jax.nn.sigmoid(gate)
    return o.astype(A).reshape(m, H * hd), k_cache, v_cache


def conv(x, w, window, n_valid, rows=False, packed=False):
    """Depthwise causal conv (window 4) + SiLU; returns fp32 y and the new window. x wider
    than w's C channels, or of another dtype than the window, is the GDN projection: its first
    C columns in the window's dtype (as the ordered op rounds them on load).
    rows: x [P, W] is one token of each of P sequences, window [3, P*C] theirs side by side
    (the ordered op's rows mode): the one-token conv on the rows folded into one row.
    packed: never here (gdn_projection packs nothing)."""
    if packed:
        raise ValueError("conv: packed=True takes the ordered backend's packed projection; the xla "
                         "backend's gdn_projection packs nothing")
    if rows:
        P, C = x.shape[0], w.shape[0]
        y, window = conv(x[:, :C].astype(window.dtype).reshape(1, P * C), jnp.tile(w, (P, 1)), window, n_valid)
        return y.reshape(P, C), window
    if x.shape[1] != w.shape[0] or x.dtype != window.dtype:
        x = x[:, :w.shape[0]].astype(window.dtype)
    m = x.shape[0]
    u = jnp.concatenate([window.astype(x.dtype), x], axis=0).astype(f32)
    wf = w.astype(f32)
    y = sum(wf[None, :, j] * u[j: j + m] for j in range(4))
    new_window = lax.dynamic_slice_in_dim(jnp.concatenate([window, x.astype(window.dtype)], 0), n_valid, 3, axis=0)
    return jax.nn.silu(y), new_window


def _l2norm(x):
    return x * (1.0 / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6))


def delta_inputs(y, b, a, A_log, dt_bias, *, nk, dk, nv, dv):
    """Split the conv output and form the delta-rule inputs (all fp32)."""
    m = y.shape[0]
    q = y[:, : nk * dk].reshape(m, nk, dk)
    k = y[:, nk * dk: 2 * nk * dk].reshape(m, nk, dk)
    v = y[:, 2 * nk * dk:].reshape(m, nv, dv)
    rep = nv // nk
    q = jnp.repeat(_l2norm(q) * f32(dk ** -0.5), rep, axis=1)
    k = jnp.repeat(_l2norm(k), rep, axis=1)
    beta = jax.nn.sigmoid(b)
    g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a + dt_bias.astype(f32))
    return q, k, v, beta, g


def delta(y, b, a, A_log, dt_bias, state, n_valid, *, nk, dk, b_col=0, a_col=0, rows=False):
    """Gated delta rule over m rows, carrying the fp32 state [nv, dk, dv]; b and a hold a
    row's nv gates at columns b_col / a_col. rows: y [P, C] is one token of each of P
    sequences, state [P*nv, dk, dv] theirs side by side (the ordered op's rows mode): the
    one-token rule on the rows folded into one row of P*nv heads, [q | k | v] of every row."""
    if rows:
        P, nv = y.shape[0], A_log.shape[0]
        qk = nk * dk
        y1 = jnp.concatenate([y[:, :qk].reshape(1, -1), y[:, qk:2 * qk].reshape(1, -1), y[:, 2 * qk:].reshape(1, -1)],
                             axis=1)
        o, state = delta(y1, b[:, b_col:b_col + nv].reshape(1, -1), a[:, a_col:a_col + nv].reshape(1, -1),
                         jnp.tile(A_log, P), jnp.tile(dt_bias, P), state, n_valid, nk=P * nk, dk=dk)
        return o.reshape(P, nv, -1), state
    nv, _, dv = state.shape
    b, a = b[:, b_col:b_col + nv], a[:, a_col:a_col + nv]
    q, k, v, beta, g = delta_inputs(y, b, a, A_log, dt_bias, nk=nk, dk=dk, nv=nv, dv=dv)

    def step(S, inp):
        qt, kt, vt, bt, gt, valid = inp
        Sn = S * jnp.exp(gt)[:, None, None]
        kv = jnp.einsum("hkv,hk->hv", Sn, kt)
        d = (vt - kv) * bt[:, None]
        Sn = Sn + kt[:, :, None] * d[:, None, :]
        o = jnp.einsum("hkv,hk->hv", Sn, qt)
        return jnp.where(valid, Sn, S), o

    valid = jnp.arange(y.shape[0]) < n_valid
    state, o = lax.scan(step, state, (q, k, v, beta, g, valid))
    return o, state


def delta_blocked(y, b, a, A_log, dt_bias, state, pending_k, pending_u, pending_c, pos, n_valid, *, nk, dk):
    """The chunk-aligned delta rule (docs/DESIGN.md §9, NUMERICS.md "delta_blocked") over m rows.

    state [nv, dk, dv] is S0, the state at the start of the block of position pos; pending_*
    hold the block's rows before pos (slot j = position % B, B = pending_k.shape[1]). Each row
    computes its block arithmetic over all B slots, slots at or past its own masked by where
    (never 0 * garbage); a row in the last slot closes the block (S0 <- S_B, pending cleared).
    The reference: same formulas and rounding points as the kernel, einsum sums in XLA's order."""
    nv, _, dv = state.shape
    B = pending_k.shape[1]
    q, k, v, beta, g = delta_inputs(y, b, a, A_log, dt_bias, nk=nk, dk=dk, nv=nv, dv=dv)
    slots = jnp.arange(B)

    def step(carry, inp):
        S0, K, U, Cl = carry
        qt, kt, vt, bt, gt, r = inp
        i = (pos + r) % B
        c = jnp.where(i == 0, gt, Cl[:, jnp.maximum(i - 1, 0)] + gt)  # [nv]
        G = jnp.exp(c)
        before = (slots < i)[None, :]  # [1, B]
        w = jnp.where(before, jnp.exp(c[:, None] - Cl), 0.0)
        Ub = jnp.where(before[..., None], U, 0.0)
        akk = jnp.where(before, w * jnp.einsum("hk,hjk->hj", kt, K), 0.0)
        aqk = jnp.where(before, w * jnp.einsum("hk,hjk->hj", qt, K), 0.0)
        ks0 = jnp.einsum("hkv,hk->hv", S0, kt)
        u = bt[:, None] * ((vt - G[:, None] * ks0) - jnp.einsum("hj,hjv->hv", akk, Ub))
        qs0 = jnp.einsum("hkv,hk->hv", S0, qt)
        o = G[:, None] * qs0 + (jnp.einsum("hj,hjv->hv", aqk, Ub) + jnp.sum(qt * kt, -1)[:, None] * u)
        K2, U2, C2 = K.at[:, i].set(kt), U.at[:, i].set(u), Cl.at[:, i].set(c)
        upto = (slots <= i)[None, :]
        e = jnp.where(upto, jnp.exp(c[:, None] - C2), 0.0)
        SB = G[:, None, None] * S0 + jnp.einsum("hj,hjk,hjv->hkv", e, jnp.where(upto[..., None], K2, 0.0),
                                                jnp.where(upto[..., None], U2, 0.0))
        close = i == B - 1
        new = (jnp.where(close, SB, S0), jnp.where(close, 0.0, K2), jnp.where(close, 0.0, U2),
               jnp.where(close, 0.0, C2))
        valid = r < n_valid
        carry = tuple(jnp.where(valid, n_, o_) for n_, o_ in zip(new, carry))
        return carry, jnp.where(valid, o, 0.0)

    rows = jnp.arange(y.shape[0])
    (S0, K, U, Cl), o = lax.scan(step, (state, pending_k, pending_u, pending_c), (q, k, v, beta, g, rows))
    return o, S0, K, U, Cl


def moe(h, router, gate_up, down, shared_gate_up, shared_down, shared_gate, *, top_k):
    """Routed top-k experts plus gated shared expert (NUMERICS.md, MoE)."""
    m, D = h.shape
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    A = h.dtype
    p = jax.nn.softmax(matmul(h, router), axis=-1)
    # lax.top_k breaks ties towards the lower index, as the contract asks.
    w, idx = lax.top_k(p, top_k)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    # Group (token, slot) pairs by expert and run them as one ragged matmul.
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok = (order // top_k)
    xs = h[tok]
    sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    dn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    gu = lax.ragged_dot_general(xs, gate_up, sizes, dn, preferred_element_type=f32)
    act = (jax.nn.silu(gu[:, :I]) * gu[:, I:]).astype(A)
    # each expert's output rounded to the activation dtype, as a bf16 model's experts return it
    ys = lax.ragged_dot_general(act, down, sizes, dn, preferred_element_type=f32).astype(A).astype(f32)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(m, top_k, D)
    routed = jnp.zeros((m, D), f32)
    for s in range(top_k):  # slot order, as written in the contract
        routed = routed + w[:, s, None] * y[:, s]
    sgu = matmul(h, shared_gate_up)
    Is = sgu.shape[1] // 2
    s_out = matmul((jax.nn.silu(sgu[:, :Is]) * sgu[:, Is:]).astype(A), shared_down).astype(A).astype(f32)
    sg = jax.nn.sigmoid(matmul(h, shared_gate))
    return routed + sg * s_out


def attention_rows(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, table, slot, pos, *, num_heads, num_kv_heads,
                   eps):
    """attention for m rows, row r slot[r]'s token at pos[r] over paged pools [NP, page, Hkv, hd]
    through the table [P, T] (slot -1: padding, o = 0, nothing written; a -1 page reads as zeros).
    Every row's k/v is written first, then each row attends to its slot's positions 0 .. pos[r]
    of the contiguous cache its pages stand for (a reference: one row at a time through lax.map,
    on pool.gather_cache, so its bytes do not depend on where the pages lie)."""
    m = qkv.shape[0]
    NP, page, hkv, hd = k_pages.shape
    S = table.shape[1] * page
    H = num_heads
    A = k_pages.dtype
    qg = qkv[:, : 2 * H * hd].reshape(m, H, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = qkv[:, 2 * H * hd: (2 * H + hkv) * hd].reshape(m, hkv, hd)
    v = qkv[:, (2 * H + hkv) * hd:].reshape(m, hkv, hd)
    q = rope(head_rmsnorm(q, q_norm, eps), cos, sin).astype(A)
    k = rope(head_rmsnorm(k, k_norm, eps), cos, sin).astype(A)
    at = jnp.clip(pos, 0, S - 1)
    pg = table[jnp.maximum(slot, 0), at // page]
    where = jnp.where((slot >= 0) & (pg >= 0), pg, NP)  # out of range -> dropped
    k_pages = k_pages.at[where, at % page].set(k, mode="drop")
    v_pages = v_pages.at[where, at % page].set(v.astype(A), mode="drop")
    rep = H // hkv

    def one(row):
        qr, gr, s_, p_ = row
        tr = lax.dynamic_index_in_dim(table, jnp.maximum(s_, 0), keepdims=False)
        kc, vc = gather_cache(k_pages, tr), gather_cache(v_pages, tr)
        seen = jnp.arange(S) <= p_
        s = jnp.einsum("grd,sgd->grs", qr.reshape(hkv, rep, hd), kc, preferred_element_type=f32) * f32(hd ** -0.5)
        p = jax.nn.softmax(jnp.where(seen[None, None], s, -jnp.inf), axis=-1)
        v_seen = jnp.where(seen[:, None, None], vc, jnp.zeros((), A))  # unwritten rows may be NaN
        o = jnp.einsum("grs,sgd->grd", p.astype(A), v_seen, preferred_element_type=f32).reshape(H, hd)
        o = jnp.where(s_ >= 0, o * jax.nn.sigmoid(gr), 0.0)
        return o.astype(A).reshape(H * hd)

    return lax.map(one, (q, gate, slot, pos)), k_pages, v_pages


def log_softmax(x):
    """Row-wise log-softmax of fp32 logits [m, V]: (x - max) - log(sum(exp(x - max)))."""
    x = x.astype(f32)
    mx = jnp.max(x, axis=-1, keepdims=True)
    return (x - mx) - jnp.log(jnp.sum(jnp.exp(x - mx), axis=-1, keepdims=True))
