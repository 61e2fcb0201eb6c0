"""The GPU scratch sizes come from the kernel library (csrc/common/scratch_layout.h, exported by
the CPU library): they equal the layouts written out by hand below, piece by piece, at several
shapes, and the Python callers (the _small ops' bounds, the budget) use them."""
from __future__ import annotations

import pytest

from custom_calls import scratch_bytes
from custom_calls.attention import small_scratch_bytes as attention_small_bytes
from custom_calls.moe import host_small_scratch_bytes, small_scratch_bytes as moe_small_bytes


def up(n):
    return (n + 255) // 256 * 256


def moe_by_hand(m, E, k, I, Is, D, fold, fused, tail, stage):
    """csrc/gpu/moe.cu's layout as its pieces: logits, ids, wts, srow, inv, tiles, n_tiles, cnt,
    [gu], act, ys, sgu, sact, sout, sgl, [tail_cnt], [stage_gu, stage_dn]."""
    if m == 0:
        return 0
    P = m * k
    R = P + fold * m  # the folded shared expert's rows
    bm = 1 if m == 1 else 16
    max_tiles = P // bm + min(E, P) + (-(-m // bm) if fold else 1)
    chunks = -(-P // 512)
    pieces = [4 * (m * E + fold * m), 4 * P, 4 * P, 4 * R, 4 * P, 12 * max_tiles, 4, 4 * chunks * E,
              0 if fused else 4 * P * 2 * I, 2 * R * I, 4 * R * D, 4 * m * 2 * Is, 2 * m * Is, 4 * m * D, 4 * m,
              4 * ((D + 7) // 8) if tail else 0, 2 * k * 2 * I * D if stage else 0, 2 * k * D * I if stage else 0]
    return sum(up(b) for b in pieces if b)


SHAPES = [  # m, E, k, I, Is, D
    (1, 8, 2, 16, 24, 32), (2, 8, 3, 16, 24, 32), (5, 8, 2, 72, 40, 136), (16, 256, 8, 512, 512, 2048),
    (300, 8, 2, 72, 40, 136), (700, 8, 2, 20, 40, 36), (1, 256, 8, 512, 512, 2048), (8192, 256, 8, 512, 512, 2048),
    (0, 8, 2, 16, 16, 32),
]


@pytest.mark.parametrize("m,E,k,I,Is,D", SHAPES)
@pytest.mark.parametrize("flags", [(0, 1, 0, 0), (0, 0, 0, 0), (1, 1, 1, 0), (1, 1, 0, 1), (1, 0, 1, 1)])
def test_moe_scratch_is_the_layout(m, E, k, I, Is, D, flags):
    fold, fused, tail, stage = flags
    got = scratch_bytes("moe", m=m, E=E, k=k, I=I, Is=Is, D=D, fold=fold, fused=fused, tail=tail, stage=stage)
    assert got == moe_by_hand(m, E, k, I, Is, D, *flags)


def test_moe_scratch_known_sizes():
    # the full model's prefill chunk of 8192 rows: the H200 reported RESOURCE_EXHAUSTED for 722685440 bytes
    assert scratch_bytes("moe", m=8192, E=256, k=8, I=512, Is=512, D=2048, fold=0, fused=1, tail=0, stage=0) \
        == 722_685_440
    # one token of small shapes, every optional piece: 16 pieces of 256 bytes, but ys (4 * 3 rows * 32) takes 512
    assert scratch_bytes("moe", m=1, E=8, k=2, I=16, Is=24, D=32, fold=1, fused=0, tail=1, stage=0) == 15 * 256 + 512


@pytest.mark.parametrize("m,D,E,I,Is,k", [(1, 32, 8, 16, 24, 3), (2, 256, 8, 64, 64, 3), (16, 2048, 256, 512, 512, 8),
                                          (7, 136, 8, 72, 40, 2)])
def test_small_bounds_cover_every_plan(m, D, E, I, Is, k):
    """The _small ops' scratch results hold any plan's layout (moe_plan picks it per call): the
    fold's extra row, the unfused gu buffer and the tail counters are all counted."""
    bound = moe_small_bytes(m, D, E, I, Is, k)
    assert bound == moe_by_hand(m, E, k, I, Is, D, 1, 0, 1, 0)
    for fold in (0, 1):
        for fused in (0, 1):
            for tail in (0, 1):
                assert moe_by_hand(m, E, k, I, Is, D, fold, fused, tail, 0) <= bound
    host = host_small_scratch_bytes(m, D, E, I, Is, k)
    assert host == moe_by_hand(m, E, k, I, Is, D, 1, 0, 1, 1)
    assert host - bound == up(2 * k * 2 * I * D) + up(2 * k * D * I)  # the staging slots


def attention_by_hand(m, S, H, Hkv, hd, hip):
    if m == 0 or m > 16:
        return 0
    splits = -(-S // 512)
    if hip:
        slots = H * splits * 16
    else:
        rows = m * (H // Hkv)
        tile = 16 if rows <= 16 else 64
        slots = Hkv * splits * (-(-rows // tile) * tile)
    return up(4 * slots * hd) + 8 * slots


@pytest.mark.parametrize("m,S,H,Hkv,hd", [(1, 1100, 4, 2, 32), (2, 3000, 4, 2, 64), (16, 1400, 16, 2, 256),
                                          (3, 512, 8, 8, 128), (17, 4096, 16, 2, 256), (16, 131072, 16, 2, 256)])
def test_attention_scratch_is_the_layout(m, S, H, Hkv, hd):
    for hip in (0, 1):
        assert scratch_bytes("attention", m=m, S=S, H=H, Hkv=Hkv, hd=hd, hip=hip) == \
            attention_by_hand(m, S, H, Hkv, hd, hip)
    if m <= 16:
        assert attention_small_bytes(m, S, H, Hkv, hd) == max(attention_by_hand(m, S, H, Hkv, hd, h) for h in (0, 1))
    # one decode row at 1100 positions, CUDA: 2 kv heads x 3 splits x 16 rows, hd 32
    assert scratch_bytes("attention", m=1, S=1100, H=4, Hkv=2, hd=32, hip=0) == up(4 * 96 * 32) + 8 * 96


def test_budget_plans_the_kernels_moe_scratch():
    from baro_jax import budget
    from baro_jax.config import preset
    cfg = preset("qwen3.5-35b-a3b")
    E, k, I, Is, D = cfg.num_experts, cfg.top_k, cfg.moe_inter, cfg.shared_inter, cfg.hidden_size
    for m in (1, 2, 37, 64, 65, 255, 256, 8192):
        for fused in (True, False):
            fold = int(I == Is) if m == 1 else int(m <= 64 or m * k < 8 * E)
            assert budget.moe_scratch_bytes(cfg, m, fused) == moe_by_hand(m, E, k, I, Is, D, fold, fused, fold, 0)
    assert budget.moe_scratch_bytes(cfg, 0) == 0


def test_scratch_bytes_refuses_bad_calls():
    with pytest.raises(ValueError, match="op must be one of moe, attention"):
        scratch_bytes("conv", m=1)
    with pytest.raises(TypeError, match="missing hip"):
        scratch_bytes("attention", m=1, S=1, H=1, Hkv=1, hd=1)
    with pytest.raises(ValueError, match=r"m must be in \[0, 2\*\*31\), got -1"):
        scratch_bytes("attention", m=-1, S=1, H=1, Hkv=1, hd=1, hip=0)
    with pytest.raises(TypeError, match="S must be an int"):
        scratch_bytes("attention", m=1, S=1.5, H=1, Hkv=1, hd=1, hip=0)
