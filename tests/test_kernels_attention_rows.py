"""baro_attention_rows: m rows of many sequences in one call over paged KV pools, each row the
bytes of baro_attention's one-row call on the contiguous cache its slot's pages stand for (the
decode path), and a chunk of one slot's rows the bytes of the one-sequence op; the pages written
exactly where the rows say (pages in shuffled order, pages past a slot's rows unmapped, spare
pages untouched); padding rows zero; an unmapped page below a row's position read as zeros; the
KV splits fixed at absolute positions (rows crossing 512 and past 1024); errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from baro_jax import ops_ordered, ops_xla
from custom_calls.testing import BF16, EPS, J_ATT, assert_close, assert_same_bits, f32, i32, put, rope_tables
from kernel_util import platform, poison


J_ROWS = jax.jit(cc.attention_rows, static_argnames=("eps",))
J_ROWS_DONATE = jax.jit(cc.attention_rows, static_argnames=("eps",), donate_argnums=(5, 6))

# (H, Hkv, hd, R2): small, the model's (G = 8, head_dim 256, rotary 64 of 256), G = 1, and
# G = 32 (the CUDA decode path's 64-row tile: more q heads per kv head than a 16-row tile holds)
SHAPES = {"g2_hd32": (4, 2, 32, 8), "g8_hd256": (16, 2, 256, 32), "g1_hd64": (2, 2, 64, 8),
          "g32_hd32": (32, 1, 32, 8)}
PAGE = 64
S = 18 * PAGE  # room for rows past 1024: three 512-position splits
TABLES = {R2: rope_tables(S, R2) for R2 in {v[3] for v in SHAPES.values()}}

# A call's rows as runs (slot, first position, rows): the run's rows sit at consecutive
# positions from the slot's history length (one row: a decode step; more: a prefill chunk).
# -1 runs are padding rows. Positions cross the 512 split and go past 1024.
CASES = {
    "m1": (1, [(0, 37, 1)]),
    "m1_split": (2, [(1, 512, 1)]),
    "m2": (3, [(2, 600, 1), (0, 5, 1)]),
    "odd7": (6, [(3, 511, 1), (0, 1024, 1), (5, 0, 1), (-1, 0, 1), (1, 1099, 1), (4, 513, 1), (2, 1023, 1)]),
    "chunk11": (2, [(1, 505, 10), (0, 1030, 1)]),
    "chunk21": (2, [(1, 500, 20), (0, 1020, 1)]),
    "mixed37": (6, [(4, 1010, 1), (2, 490, 13), (-1, 0, 2), (0, 3, 1), (5, 1030, 9), (1, 64, 1),
                    (3, 0, 8), (-1, 0, 2)]),
}


def rows_of(runs):
    slot, pos = [], []
    for s, p, n in runs:
        slot += [s] * n
        pos += list(range(p, p + n)) if s >= 0 else [0] * n
    return np.array(slot, np.int32), np.array(pos, np.int32)


def setup(rng, shape, P, runs):
    """Random rows, pools whose slots hold random history below their run's first position
    and NaN everywhere else (an unwritten row that is read shows up)."""
    H, Hkv, hd, R2 = shape
    slot, pos = rows_of(runs)
    m = len(slot)
    cos_t, sin_t = TABLES[R2]
    qkv = f32(rng, m, (2 * H + 2 * Hkv) * hd, scale=1.5)
    qn = f32(rng, hd, scale=0.2)
    kn = f32(rng, hd, scale=0.2)
    # padding rows get garbage tables and positions: they must not matter
    cos = np.where((slot >= 0)[:, None], cos_t[pos], f32(rng, m, R2, scale=3.0))
    sin = np.where((slot >= 0)[:, None], sin_t[pos], f32(rng, m, R2, scale=3.0))
    pos = np.where(slot >= 0, pos, rng.integers(-5, 2 * S, m)).astype(np.int32)
    kp = np.full((P, S, Hkv, hd), np.nan, np.float32).astype(BF16)
    vp = kp.copy()
    for s, p, _ in runs:
        if s >= 0:
            kp[s, :p] = (rng.standard_normal((p, Hkv, hd), dtype=np.float32) * 2.0).astype(BF16)
            vp[s, :p] = rng.standard_normal((p, Hkv, hd), dtype=np.float32).astype(BF16)
    return qkv, qn, kn, cos.astype(np.float32), sin.astype(np.float32), kp, vp, slot, pos


def to_pages(rng, kp, vp, slot, pos, spare=3, unmapped=()):
    """The contiguous pools [P, S, Hkv, hd] as pages in shuffled order and their table: a slot's
    pages up to its highest row (and its history) are mapped, the ones past it and (slot, page)
    pairs in `unmapped` are not (-1); `spare` pages no table entry names hold NaN."""
    P = kp.shape[0]
    T = S // PAGE
    top = np.full((P,), -1)
    for s, p in zip(slot, pos):
        if s >= 0:
            top[s] = max(top[s], p)
    mapped = [(s, t) for s in range(P) for t in range(T) if t * PAGE <= top[s] and (s, t) not in unmapped]
    NP = len(mapped) + spare
    ids = rng.permutation(NP)[:len(mapped)]
    table = np.full((P, T), -1, np.int32)
    kg = np.full((NP, PAGE) + kp.shape[2:], np.nan, np.float32).astype(BF16)
    vg = kg.copy()
    for (s, t), i in zip(mapped, ids):
        table[s, t] = i
        kg[i], vg[i] = kp[s, t * PAGE:(t + 1) * PAGE], vp[s, t * PAGE:(t + 1) * PAGE]
    return kg, vg, table


def from_pages(pages, table, like):
    """The contiguous pools the pages stand for; positions of unmapped pages keep `like`'s."""
    out = like.copy()
    for s, t in zip(*np.nonzero(table >= 0)):
        out[s, t * PAGE:(t + 1) * PAGE] = pages[table[s, t]]
    return out


def run_rows(dev, qkv, qn, kn, cos, sin, kp, vp, slot, pos, donate=False, seed=0, unmapped=()):
    """The call on the contiguous pools' pages (shuffled by `seed`); returns o and the pools as
    contiguous arrays again, after checking that no spare page was touched."""
    H = (qkv.shape[1] // qn.shape[0] - 2 * kp.shape[2]) // 2
    kg, vg, table = to_pages(np.random.default_rng(seed), kp, vp, slot, pos, unmapped=unmapped)
    poison(dev, (qkv.shape[0], H * qn.shape[0]), jnp.bfloat16)
    fn = J_ROWS_DONATE if donate else J_ROWS
    o, k2, v2 = fn(*put(dev, qkv, qn, kn, cos, sin, kg, vg, table, slot, pos), eps=EPS)
    k2, v2 = np.asarray(k2), np.asarray(v2)
    spare = np.setdiff1d(np.arange(kg.shape[0]), table[table >= 0])
    assert_same_bits(k2[spare], kg[spare], "k pages no table entry names")
    assert_same_bits(v2[spare], vg[spare], "v pages no table entry names")
    return np.asarray(o), from_pages(k2, table, kp), from_pages(v2, table, vp)


def one_row_reference(dev, qkv, qn, kn, cos, sin, kp, vp, slot, pos):
    """Every valid row through baro_attention's decode path (m = 1) on its own slot's cache, in
    position order per slot (a row's earlier positions are written first, as the op promises)."""
    outs = {}
    kc = {s: put(dev, kp[s]) for s in set(slot.tolist()) if s >= 0}
    vc = {s: put(dev, vp[s]) for s in kc}
    qn_d, kn_d = put(dev, qn, kn)
    for r in sorted(np.flatnonzero(slot >= 0), key=lambda r: (slot[r], pos[r])):
        s = int(slot[r])
        orow, kc[s], vc[s] = J_ATT(put(dev, qkv[r:r + 1]), qn_d, kn_d, *put(dev, cos[r:r + 1], sin[r:r + 1]),
                                   kc[s], vc[s], i32(pos[r]), i32(1), eps=EPS)
        outs[r] = np.asarray(orow)[0]
    k_ref, v_ref = kp.copy(), vp.copy()
    for s in kc:
        k_ref[s], v_ref[s] = np.asarray(kc[s]), np.asarray(vc[s])
    return outs, k_ref, v_ref


def _skip_slow(platform, shape, m):
    H, _, hd, _ = shape
    if platform.platform == "cpu" and hd == 256 and m > 8:
        pytest.skip("CPU: the model-size head with tens of one-row reference calls is slow; the CPU "
                    "order is covered by the smaller heads and by m <= 7 here")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_rows_equal_one_row_calls(platform, shape_name, case):
    shape = SHAPES[shape_name]
    P, runs = CASES[case]
    m = sum(n for _, _, n in runs)
    _skip_slow(platform, shape, m)
    rng = np.random.default_rng(hash((shape_name, case)) % 2 ** 32)
    qkv, qn, kn, cos, sin, kp, vp, slot, pos = setup(rng, shape, P, runs)
    o, k2, v2 = run_rows(platform, qkv, qn, kn, cos, sin, kp, vp, slot, pos)
    H, Hkv, hd, _ = shape
    assert o.dtype == BF16 and o.shape == (m, H * hd)

    ref, k_ref, v_ref = one_row_reference(platform, qkv, qn, kn, cos, sin, kp, vp, slot, pos)
    for r in range(m):
        if slot[r] >= 0:
            assert_same_bits(o[r], ref[r], f"o row {r} (slot {slot[r]}, pos {pos[r]}) vs its one-row call, "
                                           f"{shape_name}/{case}")
        else:
            assert_same_bits(o[r], np.zeros_like(o[r]), f"padding row {r}, {shape_name}/{case}")
    assert_same_bits(k2, k_ref, f"k_pool vs one-row calls, {shape_name}/{case}")
    assert_same_bits(v2, v_ref, f"v_pool vs one-row calls, {shape_name}/{case}")
    # exactly the rows' positions were written: history and NaN poison elsewhere unchanged
    written = np.zeros((P, S), bool)
    written[slot[slot >= 0], pos[slot >= 0]] = True
    for name, got, before in (("k", k2, kp), ("v", v2, vp)):
        assert_same_bits(got[~written], before[~written], f"{name}_pool rows no row names, {shape_name}/{case}")
        assert not np.any(np.isnan(got[written].astype(np.float32))), f"{name}_pool rows not all written"
    assert np.all(np.isfinite(o.astype(np.float32))), "o: non-finite values"

    # the rows in another order: the same bytes per row and the same pools
    perm = rng.permutation(m)
    o_p, k_p, v_p = run_rows(platform, qkv[perm], qn, kn, cos[perm], sin[perm], kp, vp, slot[perm], pos[perm])
    assert_same_bits(o_p, o[perm], f"o, rows permuted, {shape_name}/{case}")
    assert_same_bits(k_p, k2, f"k_pool, rows permuted, {shape_name}/{case}")
    assert_same_bits(v_p, v2, f"v_pool, rows permuted, {shape_name}/{case}")


@pytest.mark.parametrize("shape_name", ["g2_hd32", "g8_hd256", "g32_hd32"])
def test_chunk_equals_one_sequence_op(platform, shape_name):
    """A chunk of one slot's consecutive rows beside other slots' rows: the bytes of
    baro_attention on that slot's cache with the chunk alone (its prefill path)."""
    shape = SHAPES[shape_name]
    runs = [(0, 700, 1), (2, 480, 40), (1, 1030, 1), (-1, 0, 1), (3, 0, 17)]
    if platform.platform == "cpu" and shape[2] == 256:
        runs = [(0, 700, 1), (2, 505, 9), (-1, 0, 1)]
    rng = np.random.default_rng(77 + len(shape_name))
    qkv, qn, kn, cos, sin, kp, vp, slot, pos = setup(rng, shape, 4, runs)
    o, k2, v2 = run_rows(platform, qkv, qn, kn, cos, sin, kp, vp, slot, pos)
    for s, p, n in runs:
        if s < 0 or n == 1:
            continue
        rows = np.flatnonzero(slot == s)
        oc, kc, vc = J_ATT(*put(platform, qkv[rows], qn, kn, cos[rows], sin[rows], kp[s], vp[s]),
                           i32(p), i32(n), eps=EPS)
        assert_same_bits(o[rows], np.asarray(oc), f"chunk of slot {s} ({n} rows from {p}) vs baro_attention")
        assert_same_bits(k2[s], np.asarray(kc), f"k_pool[{s}] vs baro_attention's cache")
        assert_same_bits(v2[s], np.asarray(vc), f"v_pool[{s}] vs baro_attention's cache")


def test_donated_pools_and_ordered_backend(platform):
    shape = SHAPES["g2_hd32"]
    P, runs = CASES["mixed37"]
    rng = np.random.default_rng(5)
    args = setup(rng, shape, P, runs)
    o, k2, v2 = run_rows(platform, *args)
    o_d, k_d, v_d = run_rows(platform, *args, donate=True)
    assert_same_bits(o_d, o, "o, donated pools")
    assert_same_bits(k_d, k2, "k_pool, donated pools")
    assert_same_bits(v_d, v2, "v_pool, donated pools")
    # the ordered backend is the custom call
    o_o, k_o, v_o = backend_rows(platform, ops_ordered, shape, args)
    assert_same_bits(o_o, o, "ops_ordered.attention_rows vs custom_calls")
    assert_same_bits(k_o, k2, "ops_ordered.attention_rows k pages")
    assert_same_bits(v_o, v2, "ops_ordered.attention_rows v pages")


# attention_rows of a backend module (ops_ordered, ops_xla) on args with their pools paged by
# to_pages: o and the k and v pools read back from the pages, as numpy.
def backend_rows(platform, ops, shape, args):
    H, Hkv, _, _ = shape
    qkv, qn, kn, cos, sin, kp, vp, slot, pos = args
    kg, vg, table = to_pages(np.random.default_rng(0), kp, vp, slot, pos)
    dev_args = put(platform, qkv, qn, kn, cos, sin, kg, vg, table, slot, pos)
    kw = dict(num_heads=H, num_kv_heads=Hkv, eps=EPS)
    o_b, k_b, v_b = jax.jit(lambda *a: ops.attention_rows(*a, **kw))(*dev_args)
    return np.asarray(o_b), from_pages(np.asarray(k_b), table, kp), from_pages(np.asarray(v_b), table, vp)


# The xla backend is the reference within float tolerance. Its own test (the name the GPU sanitizer
# run deselects): under compute-sanitizer the process dies inside XLA's kernels, not ours.
def test_attention_rows_vs_ops_xla(platform):
    shape = SHAPES["g2_hd32"]
    P, runs = CASES["mixed37"]
    args = setup(np.random.default_rng(5), shape, P, runs)
    o, k2, v2 = run_rows(platform, *args)
    o_x, k_x, v_x = backend_rows(platform, ops_xla, shape, args)
    valid = args[7] >= 0  # slot
    assert_close(o_x[valid], o[valid], 2e-2, "ops_xla.attention_rows vs ordered")
    assert_same_bits(o_x[~valid], o[~valid], "ops_xla.attention_rows padding rows")
    assert_same_bits(v_x, v2, "ops_xla.attention_rows v_pool (a plain bf16 cast)")
    written = ~np.isnan(np.asarray(k2).astype(np.float32))
    assert_close(k_x.astype(np.float32)[written], k2.astype(np.float32)[written], 2 ** -7,
                 "ops_xla.attention_rows k_pool")


@pytest.mark.parametrize("case", ["m1", "m2", "odd7", "chunk21", "mixed37"])
def test_xla_reference_table_equals_contiguous(platform, case):
    """ops_xla.attention_rows: pages in shuffled order with unmapped ones give the bytes of the
    same call on the contiguous pools (an identity table over every position)."""
    shape = SHAPES["g2_hd32"]
    P, runs = CASES[case]
    H, Hkv, hd, _ = shape
    qkv, qn, kn, cos, sin, kp, vp, slot, pos = setup(np.random.default_rng(len(case) + 40), shape, P, runs)
    f = jax.jit(lambda *a: ops_xla.attention_rows(*a, num_heads=H, num_kv_heads=Hkv, eps=EPS))
    T = S // PAGE
    ident = np.arange(P * T, dtype=np.int32).reshape(P, T)
    o_c, k_c, v_c = f(*put(platform, qkv, qn, kn, cos, sin, kp.reshape(P * T, PAGE, Hkv, hd),
                           vp.reshape(P * T, PAGE, Hkv, hd), ident, slot, pos))
    k_c, v_c = np.asarray(k_c).reshape(kp.shape), np.asarray(v_c).reshape(vp.shape)
    kg, vg, table = to_pages(np.random.default_rng(1), kp, vp, slot, pos)
    assert np.any(table < 0) or case == "m1", "the case should leave pages unmapped"
    o_t, k_t, v_t = f(*put(platform, qkv, qn, kn, cos, sin, kg, vg, table, slot, pos))
    assert_same_bits(np.asarray(o_t), np.asarray(o_c), f"ops_xla o, paged vs contiguous, {case}")
    mapped = from_pages(np.ones((kg.shape[0], PAGE), bool), table, np.zeros((P, S), bool))
    assert_same_bits(from_pages(np.asarray(k_t), table, kp)[mapped], k_c[mapped], f"ops_xla k, {case}")
    assert_same_bits(from_pages(np.asarray(v_t), table, vp)[mapped], v_c[mapped], f"ops_xla v, {case}")


@pytest.mark.parametrize("case", ["m1", "m2", "odd7"])
def test_batch_fallback_equals_the_kernel(platform, case):
    """batch.rows_attention_fallback (one-sequence attention per row on its gathered pages,
    scattered back) gives the paged kernel's bytes for decode rows (one row per slot)."""
    from baro_jax.batch import rows_attention_fallback

    shape = SHAPES["g2_hd32"]
    H, Hkv, _, _ = shape
    P, runs = CASES[case]
    qkv, qn, kn, cos, sin, kp, vp, slot, pos = setup(np.random.default_rng(60 + len(case)), shape, P, runs)
    kg, vg, table = to_pages(np.random.default_rng(4), kp, vp, slot, pos)
    args = put(platform, qkv, qn, kn, cos, sin, kg, vg, table, slot, pos)
    want = [np.asarray(x) for x in J_ROWS(*args, eps=EPS)]
    fb = rows_attention_fallback(ops_ordered.attention)
    got = jax.jit(lambda *a: fb(*a, num_heads=H, num_kv_heads=Hkv, eps=EPS))(*args)
    for g, w, what in zip(got, want, ("o", "k pages", "v pages")):
        assert_same_bits(np.asarray(g), w, f"fallback {what} vs baro_attention_rows, {case}")


@pytest.mark.parametrize("shape_name", ["g2_hd32", "g8_hd256"])
def test_unmapped_page_below_a_row_reads_zeros(platform, shape_name):
    """A page below a row's position that maps nothing reads as zeros: the row's bytes are the
    one-row call on the contiguous cache with zeros there (what a prefill's gather gives)."""
    shape = SHAPES[shape_name]
    runs = [(0, 700, 1), (1, 130, 1), (2, 1030, 1)]
    rng = np.random.default_rng(90 + len(shape_name))
    qkv, qn, kn, cos, sin, kp, vp, slot, pos = setup(rng, shape, 3, runs)
    holes = {(0, 3), (0, 9), (1, 0), (2, 8)}  # slot 0: inside the first and the second split
    o, k2, v2 = run_rows(platform, qkv, qn, kn, cos, sin, kp, vp, slot, pos, seed=3, unmapped=holes)
    kz, vz = kp.copy(), vp.copy()
    for s, t in holes:
        kz[s, t * PAGE:(t + 1) * PAGE] = 0
        vz[s, t * PAGE:(t + 1) * PAGE] = 0
    ref, k_ref, v_ref = one_row_reference(platform, qkv, qn, kn, cos, sin, kz, vz, slot, pos)
    for r in range(len(slot)):
        assert_same_bits(o[r], ref[r], f"row {r} over unmapped pages vs the zero-filled contiguous cache")
    written = np.zeros((3, S), bool)
    written[slot, pos] = True
    assert_same_bits(k2[written], k_ref[written], "k rows written")
    assert_same_bits(v2[written], v_ref[written], "v rows written")


def _good(rng, m=3, P=2, shape=SHAPES["g2_hd32"]):
    qkv, qn, kn, cos, sin, kp, vp, slot, pos = setup(rng, shape, P, [(0, 10, 2), (1, 3, 1)][: m])
    kg, vg, table = to_pages(rng, kp, vp, slot, pos)
    return qkv, qn, kn, cos, sin, kg, vg, table, slot, pos


def test_python_refuses_bad_shapes():
    rng = np.random.default_rng(9)
    args = _good(rng)
    names = ("qkv", "qn", "kn", "cos", "sin", "kp", "vp", "table", "slot", "pos")
    qkv, qn, kn, cos, sin, kp, vp, table, slot, pos = args
    call = lambda **kw: cc.attention_rows(*[kw.get(n, v) for n, v in zip(names, args)])
    with pytest.raises(ValueError, match="at least one row"):
        call(qkv=qkv[:0], cos=cos[:0], sin=sin[:0], slot=slot[:0], pos=pos[:0])
    with pytest.raises(ValueError, match="k_pages must have rank 4"):
        call(kp=kp[0])
    with pytest.raises(ValueError, match="NP, Hkv >= 1"):
        call(kp=kp[:0], vp=vp[:0])
    with pytest.raises(ValueError, match="page size k_pages.shape\\[1\\]=32 must be a positive multiple of 64"):
        call(kp=kp[:, :32], vp=vp[:, :32])
    with pytest.raises(ValueError, match="v_pages must have shape"):
        call(vp=vp[:1])
    with pytest.raises(ValueError, match="k_pages must have dtype bfloat16"):
        call(kp=kp.astype(np.float32))
    with pytest.raises(ValueError, match="table must have rank 2"):
        call(table=table[0])
    with pytest.raises(ValueError, match="table must have dtype int32"):
        call(table=table.astype(np.int64))
    with pytest.raises(ValueError, match="table must have shape \\[P, T\\] with P, T >= 1"):
        call(table=table[:, :0])
    with pytest.raises(ValueError, match="slot must have shape"):
        call(slot=slot[:2])
    with pytest.raises(ValueError, match="pos must have dtype int32"):
        call(pos=pos.astype(np.int64))
    with pytest.raises(ValueError, match="qkv must have shape"):
        call(qkv=qkv[:, :-1])
    with pytest.raises(ValueError, match="cos must have shape"):
        call(cos=cos[:2])
    with pytest.raises(ValueError, match="R <= hd"):
        big = f32(rng, 3, 17)
        call(cos=big, sin=big)


@pytest.mark.parametrize("what,slot,pos,msg", [
    ("slot past P", [0, 2, 1], [10, 3, 11], "slot 2 is outside \\[-1, P=2\\)"),
    ("slot below -1", [0, -2, 1], [10, 3, 11], "slot -2 is outside"),
    ("pos past S", [0, 1, 1], [10, S, 11], f"pos {S} is outside \\[0, S={S}\\)"),
    ("negative pos", [0, 1, 1], [10, -1, 11], "pos -1 is outside"),
    ("two rows at one slot and pos", [1, 0, 1], [7, 10, 7], "two rows write slot 1 at pos 7"),
    ("a row in an unmapped page", [0, 1, 1], [10, 3, 700], "pos 700 is in table\\[1, 10\\], which maps no page"),
])
def test_cpu_refuses_bad_rows_at_run_time(what, slot, pos, msg):
    """The CPU refuses a bad row before writing anything (checked inside jit too)."""
    rng = np.random.default_rng(11)
    qkv, qn, kn, cos, sin, kp, vp, table, _, _ = _good(rng)
    with pytest.raises(Exception, match=msg):
        jax.block_until_ready(J_ROWS(*put(jax.devices("cpu")[0], qkv, qn, kn, cos, sin, kp, vp, table),
                                     np.array(slot, np.int32), np.array(pos, np.int32), eps=EPS))
    # the padding marker -1 with any pos is fine
    o, _, _ = J_ROWS(*put(jax.devices("cpu")[0], qkv, qn, kn, cos, sin, kp, vp, table),
                     np.array([-1, 0, -1], np.int32), np.array([-7, 10, S + 3], np.int32), eps=EPS)
    o = np.asarray(o)
    assert_same_bits(o[[0, 2]], np.zeros_like(o[[0, 2]]), f"padding rows ({what})")


@pytest.mark.parametrize("at,value,msg", [
    ((1, 0), "NP", "table\\[1, 0\\] = {NP} is outside \\[-1, NP={NP}\\)"),
    ((0, 5), -3, "table\\[0, 5\\] = -3 is outside"),
    ((1, 4), "slot 0's first page", "page {p} is mapped twice: table\\[0, 0\\] and table\\[1, 4\\]"),
])
def test_cpu_refuses_bad_tables_at_run_time(at, value, msg):
    """A table entry outside [-1, NP) or a page two entries name fails the call."""
    rng = np.random.default_rng(14)
    qkv, qn, kn, cos, sin, kp, vp, table, slot, pos = _good(rng)
    bad = table.copy()
    bad[at] = {"NP": kp.shape[0], "slot 0's first page": table[0, 0]}.get(value, value)
    with pytest.raises(Exception, match=msg.format(NP=kp.shape[0], p=table[0, 0])):
        jax.block_until_ready(J_ROWS(*put(jax.devices("cpu")[0], qkv, qn, kn, cos, sin, kp, vp, bad, slot, pos),
                                     eps=EPS))


@pytest.mark.gpu
def test_gpu_bad_rows_poisoned_not_out_of_bounds(platform):
    """On a GPU a row with a slot outside [-1, P), a pos outside [0, S), or whose position's page
    is unmapped or past NP writes nothing and gets NaN; the other rows are unaffected."""
    if platform.platform != "gpu":
        pytest.skip("GPU behaviour")
    rng = np.random.default_rng(13)
    qkv, qn, kn, cos, sin, kp, vp, table, slot, pos = _good(rng)
    dev = platform
    good_o, good_k, good_v = (np.asarray(x) for x in J_ROWS(*put(dev, qkv, qn, kn, cos, sin, kp, vp, table, slot,
                                                                   pos), eps=EPS))
    for what, t, bad_slot, bad_pos in (
            ("slot past P, pos past S", table, [0, 5, 1], [10, 11, S + 40]),
            ("pages unmapped / past NP", np.where(np.arange(table.shape[1]) == 0, table,
                                                  np.where(np.arange(table.shape[1]) == 1, kp.shape[0], -1)),
             [0, 1, 1], [10, 700, 64])):
        t = np.asarray(t, np.int32)
        o, k2, v2 = (np.asarray(x) for x in J_ROWS(*put(dev, qkv, qn, kn, cos, sin, kp, vp, t,
                                                         np.array(bad_slot, np.int32), np.array(bad_pos, np.int32)),
                                                    eps=EPS))
        assert_same_bits(o[0], good_o[0], f"the good row beside bad ones ({what})")
        assert np.all(np.isnan(o[1:].astype(np.float32))), f"bad rows must come back NaN ({what})"
        # only row 0's KV row was written
        want_k, want_v = kp.copy(), vp.copy()
        p0 = table[0, 0]
        want_k[p0, 10], want_v[p0, 10] = good_k[p0, 10], good_v[p0, 10]
        assert_same_bits(k2, want_k, f"k pages: bad rows wrote nothing ({what})")
        assert_same_bits(v2, want_v, f"v pages: bad rows wrote nothing ({what})")


@pytest.mark.parametrize("shape_name", ["g2_hd32", "g8_hd256"])
@pytest.mark.parametrize("case", ["odd7", "chunk21"])
def test_launch_knobs_same_bytes(platform, shape_name, case, monkeypatch):
    """CUDA: one copy of the decode tile's warp pair (BARO_ATTN_DUP=1) and the kernels launched as
    programmatic dependents (BARO_PDL=1) give the default launch's bytes, in the split-parallel
    (7 rows) and the in-block (21 rows) modes."""
    if platform.platform == "cpu":
        pytest.skip("the knobs pick CUDA launch shapes")
    rng = np.random.default_rng(31 + len(case))
    args = setup(rng, SHAPES[shape_name], *CASES[case])
    got = {}
    for knob in ("0", "1", "pdl"):
        monkeypatch.setenv("BARO_ATTN_DUP", "0" if knob == "pdl" else knob)
        monkeypatch.setenv("BARO_PDL", "1" if knob == "pdl" else "0")
        poison(platform, (args[0].shape[0], SHAPES[shape_name][0] * SHAPES[shape_name][2]), jnp.bfloat16)
        f = jax.jit(lambda *a: cc.attention_rows(*a))  # a fresh jit: the launcher reads the knob
        qkv, qn, kn, cos, sin, kp, vp, slot, pos = args
        kg, vg, table = to_pages(np.random.default_rng(2), kp, vp, slot, pos)
        got[knob] = [np.asarray(x) for x in f(*put(platform, qkv, qn, kn, cos, sin, kg, vg, table, slot, pos))]
    monkeypatch.delenv("BARO_ATTN_DUP", raising=False)
    monkeypatch.delenv("BARO_PDL", raising=False)
    for other in ("1", "pdl"):
        for a, b, what in zip(got["0"], got[other], ("o", "k_pool", "v_pool")):
            assert_same_bits(b, a, f"{what} with knob {other} vs default, {shape_name}/{case}")


def test_python_refuses_bad_eps():
    rng = np.random.default_rng(12)
    args = _good(rng)
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            cc.attention_rows(*args, eps=eps)
