"""Tier mode runs the many-sequence pool: each sequence of generate_batch gets the bytes of
generate() alone in tier mode and of resident generate_batch (tokens, logprobs, final state),
whether a decode step's MoE takes the rows' experts from the decode expert cache, stages the
layer whole (the rows route to more experts than the cache holds), or has no cache at all."""
import asyncio

import httpx
import numpy as np
import pytest

import baro_jax
from baro_jax import batch as B
from baro_jax import budget, staging
from batch_util import same

PROMPTS = [
    "x",  # one token
    "import os\n",
    # 54 tokens, 7 chunks of 8: prefilled while the others decode, whose steps keep its state
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n",
    "for i in range(10):\n    print(",
    "class Stack:\n    def __init__(self):\n        self.items = []",
]
NEW = [7, 1, 5, 6, 4]
CONTEXT = 1024
KW = dict(backend="ordered", max_context=CONTEXT, progress=False)


@pytest.fixture(scope="module")
def res():
    return baro_jax.load("tiny", **KW)


@pytest.fixture(scope="module")
def tier():
    eng = baro_jax.load("tiny", mode="tier", **KW)
    yield eng
    eng.runner.use_expert_cache(None)


@pytest.fixture(scope="module")
def alone(tier):
    """Each prompt alone in tier mode (the default cache, the direct decode path)."""
    return [tier.generate(p, n, logprobs=2, keep_state=True) for p, n in zip(PROMPTS, NEW)]


@pytest.fixture(scope="module")
def resident_batch(res):
    return res.generate_batch(PROMPTS, NEW, logprobs=2, max_batch=3, chunk=8, keep_states=True)


def check_equal(cfg, want, got, what):
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.state is not None and b.state is not None
        assert same(cfg, a, b) is None, f"{what}, prompt {i}: {same(cfg, a, b)}"


# slots per layer of the decode expert cache: every expert (tiny has 16); 3 (top_k is 2: a layer's
# rows route to more experts than that in most steps, which then stage it whole, and to at most 3
# in some, which take them from the cache); none (every layer staged)
@pytest.mark.parametrize("slots", [16, 3, 0])
def test_tier_batch_equals_alone_and_resident(res, tier, alone, resident_batch, slots):
    """More prompts than slots (they join as others finish), mixed lengths, prefill chunks of 8:
    each tier result is its run alone in tier mode and its resident batch result, bytes."""
    tier.runner.use_expert_cache(slots)
    cache = tier.runner.cache
    got = tier.generate_batch(PROMPTS, NEW, logprobs=2, max_batch=3, chunk=8, keep_states=True)
    check_equal(tier.cfg, alone, got, f"tier batch vs alone, {slots} slots")
    check_equal(tier.cfg, resident_batch, got, f"tier batch vs resident batch, {slots} slots")
    st = tier.last_batch_stats
    assert st["slots"] == 3 and st["steps"]["decode"] == st["steps"]["decode_calls"] > 0  # one step a call
    if slots == 16:
        s = cache.stats()
        assert s["staged_layers"] == 0 and s["hits"] > 0, s
    elif slots == 3:
        s = cache.stats()
        assert s["staged_layers"] > 0 and s["hits"] + s["misses"] > 0, s
        # the batch's copies changed the pools under the direct decode path's slot tables: a
        # sequence alone after it, on the same cache, still gets its bytes
        assert same(tier.cfg, alone[0], tier.generate(PROMPTS[0], NEW[0], logprobs=2, keep_state=True)) is None
    else:
        assert cache is None


def test_tier_batch_sampled_and_greedy_rows_equal_alone(tier):
    """Per-sequence temperature / top-k / top-p / seed beside a greedy row, two slots: each draw
    is the sequence's alone in tier mode."""
    tier.runner.use_expert_cache(3)
    sps = [baro_jax.Sampling(temperature=0.9, top_p=0.95, seed=s) for s in range(len(PROMPTS))]
    sps[1] = baro_jax.Sampling(temperature=1.3, top_k=20, seed=99)
    sps[3] = baro_jax.Sampling()
    got = tier.generate_batch(PROMPTS, 6, sampling=sps, logprobs=0, max_batch=2, chunk=8)
    tier.runner.use_expert_cache(None)
    for i, (p, s) in enumerate(zip(PROMPTS, sps)):
        a = tier.generate(p, 6, sampling=s, logprobs=0)
        assert same(tier.cfg, a, got[i]) is None, f"prompt {i}: {same(tier.cfg, a, got[i])}"


def test_tier_samples_of_a_prompt_copy_its_state_and_equal_alone(tier, alone):
    """n = 2 in tier mode: the second sample of each prompt takes a copy of the first's prompt
    state (the pool's FORK), and each equals the prompt's run alone in tier mode (greedy: both)."""
    tier.runner.use_expert_cache(3)
    got = tier.generate_batch(PROMPTS[:3], NEW[:3], n=2, logprobs=2, max_batch=6, chunk=8, keep_states=True)
    tier.runner.use_expert_cache(None)
    assert tier.last_batch_stats["steps"]["forks"] == 3
    for i in range(3):
        for j in range(2):
            assert same(tier.cfg, alone[i], got[2 * i + j]) is None, (i, j, same(tier.cfg, alone[i], got[2 * i + j]))


def test_tier_score_batch_equals_resident(res, tier):
    """score_batch (prompt logprobs of every row, staged prefill) in tier mode: resident's bytes,
    and each pair's score alone."""
    prompts, conts = PROMPTS[:3], [" return", "y = 2", "import sys"]
    got = tier.score_batch(prompts, conts, max_batch=2, chunk=8)
    want = res.score_batch(prompts, conts, max_batch=2, chunk=8)
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    assert got[0].tobytes() == tier.score(prompts[0], conts[0]).tobytes()


def test_idle_slots_do_not_widen_the_union(tier, alone):
    """A pool of four slots: three sequences decoding in slots 0, 1 and 3, slot 2 left holding the
    state of a sequence that ended at its first token (a hole that packing keeps: moving slot 3
    down would not shrink the bucket of 4 rows), a cache of 4 x top_k slots: the idle row's MoE
    input is zeroed, so it routes where a zero row does and every layer's union (at most 3 rows x
    top_k + the zero row's top_k) fits the cache; each sequence gets its bytes alone."""
    from baro_jax.scheduler import Sequence

    def seq(i):
        return Sequence(index=i, prompt_ids=alone[i].prompt_ids, max_new_tokens=NEW[i], sampling=baro_jax.Sampling(),
                        eos_ids=tier.eos_ids)

    cache = tier.runner.use_expert_cache(4 * tier.cfg.top_k)
    run = B.open_run(tier, max_batch=4, length=CONTEXT, chunk=64, logprobs=2, stop_width=4)
    seqs = [seq(i) for i in (0, 3, 1, 4)]  # slots 0..3; prompt 1 ends at its first token
    for s in seqs:
        run.add(s)
    cache.reset_stats()
    run.run()
    tier.runner.use_expert_cache(None)
    assert run.slots == 4 and run.steps["decode"] > 0 and run.steps["decode_rows"] >= 4 * NEW[4]
    assert cache.staged_layers == 0 and cache.hits + cache.misses > 0, cache.stats()
    for s in seqs:
        assert s.generated == alone[s.index].generated_ids, s.index
        assert [x.tobytes() for x in s.logprobs] == [x.tobytes() for x in alone[s.index].logprobs], s.index


def test_a_lone_sequence_steps_on_the_direct_path(res, tier):
    """Once the other sequences end, the one left decodes alone (packed into slot 0: steps of one
    row), and a step of one row runs on the direct path in one graph (the pools, the misses read
    from the host store) instead of the per-layer cache path: resident's bytes, greedy and
    sampled. Under tier_decode=cache there is no direct path and the same steps take the cache
    path, with the same bytes."""
    prompts, new = [PROMPTS[1], PROMPTS[3], PROMPTS[0]], [1, 2, 9]
    sps = [baro_jax.Sampling(), baro_jax.Sampling(), baro_jax.Sampling(temperature=0.8, seed=5)]
    want = res.generate_batch(prompts, new, sampling=sps, logprobs=2, max_batch=3, chunk=8, keep_states=True)
    direct_runs = not tier.ops.moe_host_unmet(tier.cfg)  # a GPU's MoE cannot read tiny's experts from the host
    for path in ("auto", "cache"):
        tier.tune(tier_decode=path)
        tier.runner.use_expert_cache(3)
        direct = tier.runner.direct
        assert (direct is not None) == (path == "auto" and direct_runs)
        got = tier.generate_batch(prompts, new, sampling=sps, logprobs=2, max_batch=3, chunk=8, keep_states=True)
        check_equal(tier.cfg, want, got, f"tier batch vs resident batch, tier_decode={path}")
        assert tier.last_batch_stats["steps"]["moves"] > 0  # the lone sequence packed into slot 0
        if direct is not None:
            assert direct.row_steps > 0, "no step of one row took the direct path"
            assert tier.runner.expert_cache_report()["pool_row_steps"] == direct.row_steps
    tier.tune(tier_decode="auto")
    tier.runner.use_expert_cache(None)


def test_tier_pool_compiles_nothing_per_request(tier):
    """The layer graphs of a tier decode step depend on the slot count and the pool, not on the
    prompts: a batch of other lengths compiles none."""
    tier.runner.use_expert_cache(3)
    tier.generate_batch(PROMPTS[:3], [3, 2, 4], max_batch=2, chunk=8)
    graphs = (staging._ROWS_MIXER, staging._STAGED_MOE, staging._CACHED_MOE, staging._ROWS_HEAD, staging._DIRECT_ROWS,
              B.ROWS_OUT)
    sizes = [g._cache_size() for g in graphs]
    tier.generate_batch(["import sys", "z" * 19, "q"], [4, 2, 5], max_batch=2, chunk=8)
    assert [g._cache_size() for g in graphs] == sizes
    tier.runner.use_expert_cache(None)


def test_tier_pool_slots_count_the_tier_device_part():
    """batch_slots in tier mode counts the non-expert weights, two staged layers and the cache,
    not every weight: at Qwen3.5-35B-A3B's sizes a 22 GiB budget (the H200 tier gate's) holds no
    resident weights but 16 tier slots of 4096 positions with all their KV pages, and beside a
    larger cache fewer KV pages for the same 64 slots (a slot costs its linear layers' state and
    one page; its KV only the pages its sequence holds)."""
    import jax.numpy as jnp

    cfg = baro_jax.preset("qwen3.5-35b-a3b")
    bf16 = jnp.bfloat16
    with pytest.raises(MemoryError, match="the weights need"):
        budget.check_resident(cfg, bf16, 22.0, 4096, 256)
    full = 4096 // 64  # pages of one slot at 4096 positions
    assert budget.batch_slots(cfg, bf16, 22.0, 4096, 256, 16) == (0, 0)
    assert budget.batch_slots(cfg, bf16, 22.0, 4096, 256, 16, tier_cache_slots=0) == (16, 16 * full)
    roomy = budget.batch_slots(cfg, bf16, 22.0, 4096, 256, 64, tier_cache_slots=16)
    tight = budget.batch_slots(cfg, bf16, 22.0, 4096, 256, 64, tier_cache_slots=32)
    assert roomy[0] == tight[0] == 64 and 64 <= tight[1] < roomy[1] < 64 * full, (tight, roomy)


def test_server_pool_runs_tier_mode(tier, alone):
    """The OpenAI-compatible server on a tier engine: four requests at once over two slots, each
    answer the prompt's tokens and logprob bytes alone in tier mode."""
    for server_dep in ("starlette", "uvicorn"):  # test needs; the GPU machine may lack them
        pytest.importorskip(server_dep)
    from baro_jax.serve.server import Server

    srv = Server(tier, port=0, model_name="tiny", max_batch=2, max_queue=8, max_logprobs=2, chunk=8)
    srv.start()
    try:
        async def ask(h, i):
            r = await h.post("/v1/completions", json=dict(prompt=PROMPTS[i], max_tokens=NEW[i], temperature=0,
                                                           logprobs=2, return_tokens_as_token_ids=True))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as h:
                return await asyncio.gather(*(ask(h, i) for i in (0, 2, 3, 4)))

        for i, c in zip((0, 2, 3, 4), asyncio.run(main())):
            assert c["token_ids"] == alone[i].generated_ids, i
            lps = np.asarray([np.float32(v) for v in c["logprobs"]["token_logprobs"]], np.float32)
            assert lps.tobytes() == np.asarray(alone[i].logprobs, np.float32).tobytes(), i
    finally:
        srv.stop(30)


def test_batch_identity_gate_in_tier_mode_against_a_resident_reference(bench_script, tmp_path):
    """benchmarks/batch_identity.py --mode tier --reference-json (run_gpu.sh's batch_tier stage on
    tiny): every batch sequence equals its tier run alone and every tier run alone its resident
    one; a reference whose digest differs fails the gate, one of other sequences is an error."""
    import json

    args = ("--n", "4", "--max-len", "24", "--new-tokens", "3", "--configs", "n:8", "--replay", "0")
    ref, out = tmp_path / "resident.json", tmp_path / "tier.json"
    r = bench_script("batch_identity", *args, "--json", ref)
    assert r.returncode == 0, r.stdout + r.stderr
    tier = ("--mode", "tier", "--cache-slots", "3", "--reference-json", ref, "--json", out)
    r = bench_script("batch_identity", *args, *tier)
    assert r.returncode == 0 and "runs alone vs" in r.stdout and "4/4 equal" in r.stdout, r.stdout + r.stderr
    s = json.loads(out.read_text())["summary"]
    assert s["pass"] and s["mode"] == "tier" and s["reference"]["differing"] == [] and s["expert_cache"]
    from baro_jax.verify import batch_identity as bi

    got = json.loads(out.read_text())
    d = json.loads(ref.read_text())
    d["sequences"][2]["digest"] = "0" * 64
    ref.write_text(json.dumps(d))
    acc = bi.compare_reference(got["sequences"], str(ref))
    assert acc["differing"] == [2] and acc["compared"] == 4
    assert not bi.BatchIdentityReport(sequences=got["sequences"], rows=got["rows"], reference=acc).ok
    n = d["sequences"][1]["new_tokens"]
    d["sequences"][1]["new_tokens"] += 1
    ref.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"sequence 1 has new_tokens {n + 1} there, {n} here: not the same sequences"):
        bi.compare_reference(got["sequences"], str(ref))


def test_tier_default_chunk_is_the_runners_pick(res, tier):
    """Tier mode's default batch chunk is the runner's pick for the longest prompt (every pass
    moves all the experts), not resident mode's 256; the bytes are the same either way."""
    prompt = list(np.random.default_rng(5).integers(1, 200, size=300))
    want = res.generate_batch([prompt, "x"], 2, logprobs=0, keep_states=True)
    assert res.last_batch_stats["chunk"] == B.DEFAULT_BATCH_CHUNK
    got = tier.generate_batch([prompt, "x"], 2, logprobs=0, keep_states=True)
    assert res.last_batch_stats["chunk"] == B.DEFAULT_BATCH_CHUNK
    assert tier.last_batch_stats["chunk"] == min(B.TIER_MAX_BATCH_CHUNK, tier.last_batch_stats["pool_length"],
                                                 tier.pick_chunk(300, 2)) > B.DEFAULT_BATCH_CHUNK
    check_equal(res.cfg, want, got, "tier default chunk")


@pytest.mark.parametrize("mixed", [True, False])
def test_tier_mixed_rounds_equal_alone(tier, alone, mixed):
    """In tier mode a round's prefill chunk and its decode rows run one staged pass (each layer's
    experts copied once for both; staging.mixed_forward) or two: the bytes alone either way."""
    tier.runner.use_expert_cache(3)
    tier.tune(mixed_rounds=mixed)
    try:
        got = tier.generate_batch(PROMPTS, NEW, logprobs=2, max_batch=3, chunk=8, keep_states=True)
    finally:
        tier.tune(mixed_rounds=True)
        tier.runner.use_expert_cache(None)
    check_equal(tier.cfg, alone, got, f"tier batch, mixed rounds {mixed}")
    assert (tier.last_batch_stats["steps"]["mixed"] > 0) == mixed, tier.last_batch_stats["steps"]
