"""Tier mode's budget split (issue 11): the decode expert cache sized beside a reserved prefill,
the largest prefill chunk beside the cache, the MoE's GPU scratch as csrc/gpu/moe.cu lays it out,
the runtime reserve in both modes, and the tier bench scripts recording a failure and going on.
CPU only; the full-size preset is budgeted from its Config, no weights are made."""
import json

import jax.numpy as jnp
import pytest

import baro_jax
from baro_jax import budget, staging
from baro_jax.config import load_config, preset
from baro_jax.loading import TINY_CHECKPOINT
from baro_jax.shapes import state_length
from benchmarks import speed, tier_overlap

BF16 = jnp.bfloat16
H200_BYTES = int(139.8 * 2**30)  # what the H200's allocator reports without a memory fraction
FULL = "qwen3.5-35b-a3b"


@pytest.fixture
def h200(monkeypatch):
    """Budgets as on the H200: its device memory, and the host's RAM unknown (the full-size
    preset's 60 GiB host store would not fit this machine, and is not what these tests are about)."""
    monkeypatch.setattr(budget, "device_memory_bytes", lambda: H200_BYTES)
    monkeypatch.setattr(budget, "host_memory_bytes", lambda: None)
    return preset(FULL)


def test_moe_scratch_is_the_bytes_the_h200_asked_for():
    cfg = preset(FULL)  # E=256, top_k=8, I=Is=512, D=2048
    # RESOURCE_EXHAUSTED: baro_moe: could not allocate 722685440 bytes of GPU scratch (m = 8192)
    assert budget.moe_scratch_bytes(cfg, 8192) == 722_685_440
    P = 8192 * cfg.top_k
    unfused = budget.moe_scratch_bytes(cfg, 8192, fused=False)
    assert unfused - budget.moe_scratch_bytes(cfg, 8192) == 4 * P * 2 * cfg.moe_inter  # the fp32 gu buffer
    from custom_calls.moe import small_scratch_bytes  # the decode wrapper's bound counts the fold and gu

    assert budget.moe_scratch_bytes(cfg, 1, fused=False) == small_scratch_bytes(
        1, cfg.hidden_size, cfg.num_experts, cfg.moe_inter, cfg.shared_inter, cfg.top_k)
    assert budget.activation_bytes(cfg, BF16, 8192) > budget.moe_scratch_bytes(cfg, 8192) + 8192 * cfg.hidden_size * 8


def test_cache_is_sized_beside_the_reserved_prefill(h200):
    cfg = h200
    chunk, L = budget.reserved_prefill(cfg)
    assert (chunk, L) == (budget.PREFILL_RESERVE_CHUNK, state_length(budget.PREFILL_RESERVE_CHUNK + 1, cfg.max_context))
    slots = []
    for gb in (40, 30, 24, 22, 20, 16, 14, 12):
        S, note = budget.tier_cache_slots(cfg, BF16, gb)
        slots.append(S)
        if S:
            budget.check_tier(cfg, BF16, gb, L, chunk, S)  # the reserved prefill fits beside the cache
            if S < 64:
                assert "the budget allows no more" in note, note
                with pytest.raises(MemoryError):  # and one slot more would not
                    budget.check_tier(cfg, BF16, gb, L, chunk, S + 1)
        else:
            assert "no room for the cache" in note and f"top_k is {cfg.top_k}" in note, note
            with pytest.raises(MemoryError):
                budget.check_tier(cfg, BF16, gb, L, chunk, cfg.top_k)
    assert slots == sorted(slots, reverse=True), slots
    assert slots[0] == 64 and slots[-1] == 0, slots  # every regime seen: full, budget-bound, off
    partial = [s for s in slots if 0 < s < 64]
    assert len(partial) >= 3 and len(set(partial)) == len(partial), slots  # fewer with every GiB less


def test_largest_chunk_beside_the_cache_at_22_gib(h200):
    cfg = h200
    S, _ = budget.tier_cache_slots(cfg, BF16, 22)
    assert cfg.top_k <= S < 64
    picked = {}
    for n in (8192, 32768):
        L = state_length(n + 32, cfg.max_context)  # speed.py's 32 decode tokens
        c = budget.largest_tier_chunk(cfg, BF16, 22, L, n, S)
        budget.check_tier(cfg, BF16, 22, L, c, S)
        if c < n:
            with pytest.raises(MemoryError, match=f"decode expert cache 40 x {S} slots .* runtime reserve"):
                budget.check_tier(cfg, BF16, 22, L, 2 * c, S)
        picked[n] = c
    assert picked[8192] == 8192  # an 8k prompt in one pass of the host link
    assert picked[32768] >= 4096
    # what the H200 refused before the split: identity.py --mode tier --chunks 1024,4096 --max-context 4096
    cfg4 = preset(FULL, 4096)
    S4, _ = budget.tier_cache_slots(cfg4, BF16, 22)
    assert S4 >= cfg4.top_k
    for c in (1024, 4096):
        budget.check_tier(cfg4, BF16, 22, 4096, c, S4)


def test_runtime_reserve_is_counted_in_both_modes():
    cfg = preset("tiny-random")
    for check, mode in ((budget.check_tier, "tier"), (budget.check_resident, "resident")):
        need = check(cfg, BF16, None, 1024, 16)
        with pytest.raises(MemoryError, match=rf"{mode} mode needs .* \+ runtime reserve 1\.00 GiB, more than"):
            check(cfg, BF16, (need + 4096) / 2**30, 1024, 16)  # the counted bytes alone would fit
        gb = budget.budget_gb_for(need)
        assert check(cfg, BF16, gb, 1024, 16) == need
        with pytest.raises(MemoryError, match="runtime reserve"):
            check(cfg, BF16, gb - 2**-20, 1024, 16)  # budget_gb_for is the smallest that fits
    assert budget.runtime_reserve_bytes(22 << 30) == int(budget.RUNTIME_RESERVE_FRACTION * (22 << 30)) > 1 << 30


def test_load_without_the_decode_cache():
    eng = baro_jax.load("tiny-random", mode="tier", backend="ordered", progress=False, cache_slots=0)
    assert eng.runner.cache is None and eng.cache_slots == 0 and "turned off" in eng.runner.cache_note
    with pytest.raises(ValueError, match="cache_slots \\(--cache-slots\\) sizes tier mode"):
        baro_jax.load("tiny-random", backend="ordered", progress=False, cache_slots=4)


def test_tier_overlap_records_a_failed_chunk_and_goes_on(tmp_path, monkeypatch):
    cfg = load_config(TINY_CHECKPOINT, 64 + tier_overlap.STATE_PAD)
    need = {c: budget.check_tier(cfg, BF16, None, c + tier_overlap.STATE_PAD, c) for c in (32, 64)}
    assert need[64] > need[32]
    gb = budget.budget_gb_for((need[32] + need[64]) // 2)  # chunk 32 fits, 64 does not
    real = staging.forward

    def oom_at_16(params, state, tokens, *a, **k):
        if tokens.shape[0] == 16:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")
        return real(params, state, tokens, *a, **k)

    monkeypatch.setattr(staging, "forward", oom_at_16)
    out = tmp_path / "o.json"
    rc = tier_overlap.main(["--model", "tiny", "--chunks", "16,32,64", "--repeats", "1",
                            "--device-budget-gb", repr(gb), "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 1
    r16, r32, r64 = res["rows"]
    assert r16["failed"] and "RESOURCE_EXHAUSTED" in r16["error"]
    assert not r32.get("failed") and r32["split_run_logits_equal_staged"] and r32["both_seconds"] > 0
    assert r64["failed"] and "activations at chunk 64" in r64["error"] and "runtime reserve" in r64["error"]
    for r in (r16, r32, r64):  # the count beside the device's counters (null on the CPU backend)
        assert r["budget"]["counted_bytes"] == sum(r["budget"]["parts"].values()) > 0
        assert "decode_expert_cache" not in r["budget"]["parts"]
        assert "device_memory" in r and "device_memory_before" in r
    s = res["summary"]
    assert s["failed_chunks"] == [16, 64] and s["checks_pass"] is True and not s["partial"]
    assert s["expert_cache"]["slots_per_layer"] == 0  # prefill passes only: no cache built


def test_speed_records_a_failed_length_and_goes_on(tmp_path, monkeypatch):
    real = speed.warm

    def oom_at_2048(eng, chunk, state_len):
        if state_len == 2048:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")
        return real(eng, chunk, state_len)

    monkeypatch.setattr(speed, "warm", oom_at_2048)
    out = tmp_path / "s.json"
    rc = speed.main(["--model", "tiny", "--mode", "tier", "--arms", "batch-ordered", "--lengths", "1500,40",
                     "--chunk", "16", "--decode-tokens", "2", "--check-tail", "8", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 1
    failed, ran = res["rows"]
    assert failed["prompt_tokens"] == 1500 and failed["failed"] and "RESOURCE_EXHAUSTED" in failed["error"]
    bo = ran["batch-ordered"]
    assert bo["identity"]["equal"] and bo["budget_counted_bytes"] > 0
    assert [(d["kind"], d["tokens"]) for d in bo["identity"]["details"]] == [("prefix", 40), ("tail", 8)]
    assert "device_memory" in failed and "device_memory" in ran
    s = res["summary"]
    assert s["failed_lengths"] == [1500] and s["checks_pass"]
    assert (s["check_prefix"], s["check_tail"], s["replay_max"]) == (128, 8, 0)  # tier defaults, tail as given


def test_a_callers_state_does_not_skip_the_budget():
    """prefill / prefill_chunk with a state the caller made still count the activations at the
    chunk beside the weights and that state, and refuse up front (they used to run unchecked)."""
    cfg = preset("tiny-random")
    need64 = budget.check_resident(cfg, BF16, None, 64, 64)
    eng = baro_jax.load("tiny-random", backend="ordered", progress=False,
                        device_budget_gb=budget.budget_gb_for(need64))
    ids = list(range(1, 40))
    eng.prefill(ids, chunk=64, state=eng.new_state(64))  # fits: the count it was sized for
    big = 4096  # a chunk whose activations cannot fit this budget
    assert budget.check_resident(cfg, BF16, None, 64, big) > need64
    with pytest.raises(MemoryError, match=f"activations at chunk {big}"):
        eng.prefill(ids, chunk=big, state=eng.new_state(64))
    with pytest.raises(MemoryError, match=f"activations at chunk {big}"):
        eng.prefill_chunk(ids, eng.new_state(64), 0, big)


def test_resident_default_chunk_is_the_largest_that_fits():
    """Resident mode's default chunk halves until the request fits beside the weights (the 35B-A3B's
    8k prompt on an 80 GB card takes 4096), and keeps the plain default where it fits; the engine's
    prefill then runs at that chunk with the bytes of the roomy engine's larger one."""
    cfg = preset("tiny-random")
    L = state_length(300 + 2, cfg.max_context)
    need = {c: budget.check_resident(cfg, BF16, None, L, c) for c in (64, 128)}
    assert need[128] > need[64]
    gb = budget.budget_gb_for((need[64] + need[128]) // 2)  # chunk 64 fits, 128 does not
    eng = baro_jax.load("tiny-random", device_budget_gb=gb, progress=False, backend="ordered")
    roomy = baro_jax.load("tiny-random", progress=False, backend="ordered")
    assert roomy.pick_chunk(300, 2) == 512  # shapes.default_chunk: the whole prompt in one chunk
    assert eng.pick_chunk(300, 2) == 64
    ids = [(7 * i) % 250 + 1 for i in range(300)]
    tight, full = eng.generate(ids, 2, logprobs=0), roomy.generate(ids, 2, logprobs=0)
    assert (tight.chunk, full.chunk) == (64, 512)
    assert tight.generated_ids == full.generated_ids
    assert [x.tobytes() for x in tight.logprobs] == [x.tobytes() for x in full.logprobs]

    def never(c):
        raise MemoryError(f"chunk {c} does not fit")

    assert budget.largest_fitting_chunk(never, 4096) == 16  # none fits: the smallest; the request's check refuses


def test_gpu_refusal_names_the_allocator_share(monkeypatch):
    """On a GPU the device memory a refusal quotes is JAX's share of the card: the message names
    the memory fraction that set it (given or the 0.75 default); a CPU's message does not."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.94" in budget.allocator_share_note("gpu")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert "default 0.75" in budget.allocator_share_note("gpu")
    assert budget.allocator_share_note("cpu") == ""
    # the full-size weights against 75% of an 80 GB card: the refusal carries the note
    monkeypatch.setattr(budget, "device_memory_bytes", lambda: int(0.75 * 79.1 * 2**30))
    monkeypatch.setattr(budget.jax, "devices", lambda: [type("Dev", (), {"platform": "gpu"})()])
    with pytest.raises(MemoryError, match=r"the weights need 6\d\.\d GiB.*default 0\.75.*--mode tier"):
        budget.check_resident(preset(FULL), BF16)
