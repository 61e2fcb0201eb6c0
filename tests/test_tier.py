"""Tier mode (routed experts in pinned host memory, layers from a Python loop) gives resident mode's bytes."""
import json
import os
import sys

import numpy as np
import pytest

import baro_jax
from baro_jax import budget, generate, staging
from baro_jax.verify import digests, identity

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n"  # 54 tokens: crosses chunk boundaries
NEW = 6


@pytest.fixture(scope="module", params=["tiny", "tiny-random"])
def engines(request):
    kw = dict(backend="ordered", progress=False)
    return (baro_jax.load(request.param, mode="resident", **kw), baro_jax.load(request.param, mode="tier", **kw))


def _direct_runs(tier):
    """Skip a test of the direct decode path where this device's MoE cannot read the model's experts
    from the host store (a GPU with the "tiny" model, whose shared expert is wider than a routed one:
    there direct is refused up front, which test_auto_takes_the_cache_path_... checks)."""
    unmet = tier.ops.moe_host_unmet(tier.cfg)
    if unmet:
        pytest.skip("direct tier decode cannot run here: " + "; ".join(unmet))


def test_weights_live_where_they_should(engines):
    res, tier = engines
    assert res.mode == "resident" and tier.mode == "tier"
    kinds = staging.memory_kinds(tier.params)
    experts = {k: v for k, v in kinds.items() if k.endswith("['gate_up']") or k.endswith("['down']")}
    assert len(experts) == 2 * tier.cfg.num_layers
    assert set(experts.values()) == {"pinned_host"}, experts
    others = {k: v for k, v in kinds.items() if k not in experts}
    assert set(others.values()) == {"device"}, others
    assert set(staging.memory_kinds(res.params).values()) == {"device"}


def test_tier_bytes_equal_resident(engines):
    res, tier = engines
    ids = res.encode(PROMPT)
    assert len(ids) > 37
    ref = identity.run_arm(res, ids, "batch", 16, NEW)
    arms = {"tier replay": identity.run_arm(tier, ids, "replay", None, NEW)}
    for c in (16, 7):  # 7: odd, several boundaries, a padded last chunk
        arms[f"tier batch {c}"] = identity.run_arm(tier, ids, "batch", c, NEW)
    names = digests.state_names(res.cfg)
    for name, got in arms.items():
        assert digests.first_diff(ref["state"], got["state"], names) is None, name
        assert ref["logits"].tobytes() == got["logits"].tobytes(), name
        assert ref["tokens"] == got["tokens"], name


def test_tier_prompt_logits_equal_resident(engines):
    res, tier = engines
    ids = res.encode(PROMPT)[:20]
    assert res.prompt_logits(ids).tobytes() == tier.prompt_logits(ids).tobytes()


def test_budget_refused_up_front():
    with pytest.raises(MemoryError) as e:
        baro_jax.load("tiny-random", mode="tier", device_budget_gb=0.0001, progress=False)
    msg = str(e.value)
    for s in ("tier mode needs", "non-expert weights", "two staged expert layers 2 x", "KV/state for 1024 positions",
              "the device budget of 0.0001 GiB"):
        assert s in msg, msg


def test_budget_refuses_a_request_too_long():
    cfg = baro_jax.preset("tiny-random")
    import jax.numpy as jnp

    need_1k = budget.check_tier(cfg, jnp.bfloat16, None, 1024, chunk=16)  # 10 tokens: chunk 16
    gb = budget.budget_gb_for(need_1k + (1 << 16))  # fits a 1024-position state, not a 2048 one
    eng = baro_jax.load("tiny-random", mode="tier", device_budget_gb=gb, progress=False, backend="ordered")
    eng.prefill(list(range(10)), n_new=10)
    with pytest.raises(MemoryError, match="KV/state for 2048 positions"):
        eng.prefill(list(range(10)), n_new=1500)
    with pytest.raises(MemoryError, match="activations at chunk 4096"):
        eng.prefill(list(range(10)), chunk=4096)


def test_activations_counted_in_resident_requests():
    import jax.numpy as jnp

    cfg = baro_jax.preset("tiny-random")
    base = budget.check_resident(cfg, jnp.bfloat16, None, 1024, chunk=16)
    assert budget.activation_bytes(cfg, jnp.bfloat16, 4096) > 100 * budget.activation_bytes(cfg, jnp.bfloat16, 16)
    eng = baro_jax.load("tiny-random", device_budget_gb=budget.budget_gb_for(base + (1 << 16)), progress=False,
                        backend="xla")
    eng.prefill(list(range(10)))
    with pytest.raises(MemoryError, match="resident mode needs .* activations at chunk 4096"):
        eng.prefill(list(range(10)), chunk=4096)


def test_cli_tier_json(capsys, monkeypatch):
    rc = generate.main(["--model", "tiny", "--prompt", "def add(a, b):\n", "--max-new-tokens", "4", "--mode", "tier",
                        "--chunk", "5", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    o = json.loads(out)
    assert o["mode"] == "tier" and len(o["generated_ids"]) == 4
    monkeypatch.setenv("BARO_TIER", "1")
    rc = generate.main(["--model", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and json.loads(out)["mode"] == "tier", err


def test_cli_budget_error(capsys):
    rc = generate.main(["--model", "tiny", "--mode", "tier", "--device-budget-gb", "0.0005", "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith("error: tier mode needs") and "non-expert weights" in err, err


def test_identity_gate_tier(tmp_path):
    import subprocess

    out = tmp_path / "id.json"
    gate = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "identity.py")
    p = subprocess.run([sys.executable, gate, "--model", "tiny", "--mode", "tier", "--chunks", "7,16", "--max-len", "70",
                        "--new-tokens", "4", "--json", str(out)], capture_output=True, text=True, timeout=600)
    res = json.loads(out.read_text())
    assert p.returncode == 0 and res["summary"]["pass"] and res["summary"]["mode"] == "tier", p.stderr[-2000:]


def test_tier_default_chunk_is_the_largest_that_fits():
    import jax.numpy as jnp

    cfg = baro_jax.preset("tiny-random")
    need_64 = budget.check_tier(cfg, jnp.bfloat16, None, 1024, chunk=64)
    need_128 = budget.check_tier(cfg, jnp.bfloat16, None, 1024, chunk=128)
    assert need_128 > need_64
    gb = budget.budget_gb_for((need_64 + need_128) // 2)  # chunk 64 fits, 128 does not
    eng = baro_jax.load("tiny-random", mode="tier", device_budget_gb=gb, progress=False, backend="ordered")
    assert eng.pick_chunk(300) == 64
    assert eng.pick_chunk(40) == 64  # the whole prompt in one pass
    roomy = baro_jax.load("tiny-random", mode="tier", progress=False, backend="ordered")
    assert roomy.pick_chunk(300) == 512  # one pass for the whole prompt
    res = eng.generate(list(range(1, 200)), 2)
    assert res.chunk == 64


# --- the decode expert cache (staging.ExpertCache) ------------------------------------------
def decode_run(eng, ids, n):
    """Batched prefill (chunk 16) then n greedy decode steps: every step's logits, the final state."""
    import jax
    from baro_jax.sampling import greedy

    pre = eng.prefill(ids, "batch", 16, n_new=n)
    logits, state, out = pre.logits, pre.state, []
    for i in range(n):
        out.append(np.asarray(logits))
        logits, state = eng.decode_step(int(greedy(logits)), state, len(ids) + i)
    out.append(np.asarray(logits))
    return out, [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


@pytest.mark.parametrize("fetch", ["xla", "dma"])
def test_cached_decode_bytes_equal_resident(engines, fetch, monkeypatch):
    """A pool smaller than the experts a prompt uses (evictions every step): resident decode's bytes,
    every step's logits and every state leaf, 16+ greedy tokens; the misses copied by XLA's
    dynamic slice and by the copy-engine ring (BARO_TIER_FETCH=dma)."""
    res, tier = engines
    tier.tune(tier_fetch=fetch, tier_decode="cache")  # auto would pick direct for the ordered ops
    ids = res.encode(PROMPT)[:24]
    S = tier.cfg.top_k + 1
    cache = tier.use_expert_cache(S)
    try:
        assert cache is not None and cache.slots == S
        want_logits, want_state = decode_run(res, ids, 18)
        got_logits, got_state = decode_run(tier, ids, 18)
        st = cache.stats()
        assert st["misses"] > 0 and st["evictions"] > 0 and st["hits"] > 0, st
        for i, (a, b) in enumerate(zip(want_logits, got_logits)):
            assert a.tobytes() == b.tobytes(), f"decode step {i}"
        names = digests.state_names(res.cfg)
        assert digests.first_diff(want_state, got_state, names) is None
        # and generate() reports the cache in its JSON
        r = tier.generate(ids, 6, prefill="batch", chunk=16)
        ec = r.to_json()["expert_cache"]
        assert ec["slots_per_layer"] == S and ec["hits"] + ec["misses"] == 5 * tier.cfg.num_layers * tier.cfg.top_k
        assert 0.0 <= ec["hit_rate"] <= 1.0
        if fetch == "dma":  # every copy call ran its handler, in step with the ring
            assert cache._ring.runs == cache._ring.calls > 0
    finally:
        tier.tune(tier_fetch="xla")
        tier.tune(tier_decode="auto")
        tier.use_expert_cache(None)


def test_direct_decode_bytes_equal_resident(engines, monkeypatch):
    """BARO_TIER_DECODE=direct: the pools as the cache left them (here: after LRU steps, so a mix
    of resident experts and misses), every miss read from the host store inside the MoE call,
    one graph per token: resident decode's bytes, every step's logits and every state leaf."""
    _direct_runs(engines[1])
    res, tier = engines
    ids = res.encode(PROMPT)[:24]
    S = tier.cfg.top_k + 1
    tier.tune(tier_decode="direct")
    try:
        cache = tier.use_expert_cache(S)
        assert tier.runner.direct is not None and cache is not None
        # fill some slots through the LRU path first, so the direct pools hold real experts
        for e in range(S):
            cache.ensure(e % tier.cfg.num_layers, [e])
        tier.runner.direct.refresh()
        assert any((t >= 0).any() for t in cache.slot_of)
        want_logits, want_state = decode_run(res, ids, 12)
        got_logits, got_state = decode_run(tier, ids, 12)
        for i, (a, b) in enumerate(zip(want_logits, got_logits)):
            assert a.tobytes() == b.tobytes(), f"decode step {i}"
        names = digests.state_names(res.cfg)
        assert digests.first_diff(want_state, got_state, names) is None
        # greedy blocks (one graph per 16 steps, then a shorter block): resident's tokens and state
        import jax

        n = 20
        want = res.prefill(ids, "batch", 16, n_new=n + 1)
        got = tier.prefill(ids, "batch", 16, n_new=n + 1)
        first = int(np.argmax(np.asarray(want.logits)))
        wt, ws = res.greedy_decode(first, want.state, len(ids), n)
        gt, gs = tier.greedy_decode(first, got.state, len(ids), n)
        assert wt == gt
        assert digests.first_diff([np.asarray(x) for x in jax.tree_util.tree_leaves(ws)],
                                   [np.asarray(x) for x in jax.tree_util.tree_leaves(gs)], names) is None
        # a sampled sequence drawn inside the direct path's block graph: resident's draws
        s = baro_jax.Sampling(temperature=1.0, top_k=7, top_p=0.9, seed=11)
        kw = dict(prefill="batch", chunk=16, sampling=s, stop_at_eos=False)
        assert tier.generate(ids, n, **kw).generated_ids == res.generate(ids, n, **kw).generated_ids
        r = tier.generate(ids, 4, prefill="batch", chunk=16)
        assert r.generated_ids == res.generate(ids, 4, prefill="batch", chunk=16).generated_ids
        ec = r.to_json()["expert_cache"]
        assert ec["decode_path"] == "direct" and ec["resident_share"] == S / tier.cfg.num_experts
        # 3 decode steps after the prefill's token; hits counted on the device from the MoE's own routing
        assert ec["hits"] + ec["misses"] == 3 * tier.cfg.num_layers * tier.cfg.top_k, ec
        assert ec["misses"] > 0 and 0.0 <= ec["hit_rate"] <= 1.0, ec
        tier.use_expert_cache(tier.cfg.num_experts)  # every expert resident: every routed one hits
        ec = tier.generate(ids, 4, prefill="batch", chunk=16).to_json()["expert_cache"]
        assert ec["hits"] == 3 * tier.cfg.num_layers * tier.cfg.top_k and ec["misses"] == 0, ec
    finally:
        tier.tune(tier_decode="cache")
        tier.use_expert_cache(None)
        assert tier.runner.direct is None
        tier.tune(tier_decode="auto")
        tier.use_expert_cache(None)


def test_auto_decode_path_is_direct_where_it_runs(engines, monkeypatch):
    """BARO_TIER_DECODE unset (auto): the direct path with the ordered ops, the cache path where
    the MoE cannot read the host store (ROCm; ops without moe_host)."""
    from custom_calls import _lib

    _, tier = engines
    _direct_runs(tier)
    tier.tune(tier_decode="auto")
    tier.use_expert_cache(tier.cfg.top_k + 1)
    assert tier.runner.direct is not None and tier.expert_cache_report()["decode_path"] == "direct"
    assert staging.pick_decode_path("cache", tier.ops) == "cache"
    assert staging.pick_decode_path("direct", tier.ops) == "direct"
    no_host = type("Ops", (), {"moe_slots": None, "moe_route": None})()
    assert staging.pick_decode_path("auto", no_host) == "cache"
    monkeypatch.setattr(_lib, "_xla_platform", lambda dev: "ROCM")
    assert staging.pick_decode_path("auto", tier.ops) == "cache"
    tier.use_expert_cache(tier.cfg.top_k + 1)
    assert tier.runner.direct is None and tier.expert_cache_report()["decode_path"] == "cache"
    monkeypatch.undo()
    tier.use_expert_cache(None)


def test_auto_takes_the_cache_path_where_the_gpu_kernel_cannot_read_the_models_experts(engines, monkeypatch):
    """A GPU's MoE reads the host store only in its one-token path, which needs the shared expert
    as wide as a routed one: the "tiny" model's is not (128 against 48), so on a CUDA device auto
    takes the cache path and direct is refused before any graph runs, naming why (it was a
    ValueError from inside the first decode's jitted graph)."""
    import dataclasses

    from custom_calls import _lib

    _, tier = engines
    cfg = dataclasses.replace(tier.cfg, moe_inter=48, shared_inter=128)
    monkeypatch.setattr(_lib, "_xla_platform", lambda dev: "CUDA")
    assert any("shared expert" in why for why in tier.ops.moe_host_unmet(cfg))
    assert staging.pick_decode_path("auto", tier.ops, cfg) == "cache"
    with pytest.raises(ValueError, match="tier_decode direct.*shared expert 128 wide beside routed ones 48 wide"):
        staging.pick_decode_path("direct", tier.ops, cfg)
    monkeypatch.setattr(_lib, "_xla_platform", lambda dev: None)
    assert tier.ops.moe_host_unmet(cfg) == [] and staging.pick_decode_path("auto", tier.ops, cfg) == "direct"


@pytest.mark.parametrize("fetch", ["xla", "dma"])
def test_direct_pools_follow_the_routing(engines, fetch, monkeypatch):
    """adapt(): per layer the hottest non-resident experts (decayed counts) replace the coldest
    residents when they score over the resident's score + adapt_margin (ADAPT_Z x the root of the
    layer's mean), at most ADAPT_MAX_SWAPS, their weights copied into the freed slots; then greedy decode with
    swaps between every block keeps resident decode's bytes (tokens and state)."""
    _direct_runs(engines[1])
    import jax

    res, tier = engines
    L, E, k = tier.cfg.num_layers, tier.cfg.num_experts, tier.cfg.top_k
    S = k + 1
    tier.tune(tier_fetch=fetch, tier_decode="direct")
    try:
        cache = tier.use_expert_cache(S)
        d = tier.runner.direct
        assert d.adaptive and d.swaps == 0
        before = [t.copy() for t in cache.slot_of]  # each layer: experts 0 .. S-1 resident
        counts = np.zeros((L, E), np.int32)
        counts[0, E - 1] = 50  # hot: replaces a resident with no count
        counts[0, E - 2] = 1   # not over 0 + the margin: stays out
        counts[1, :S] = 5      # residents warm ...
        counts[1, E - 1] = 60  # ... 60 is over 5 + the margin: in
        counts[1, E - 2] = 8   # 8 is not: out
        for layer in (0, 1):
            margin = staging.adapt_margin(counts[layer])
            assert counts[layer, E - 2] <= counts[layer, 0] + margin < counts[layer, E - 1]
        d._counts = [(jax.numpy.asarray(counts), staging.ADAPT_EVERY)]
        d.adapt(keep_last=False)
        assert d.swaps == 2
        t0, t1 = cache.slot_of[0], cache.slot_of[1]
        assert t0[E - 1] >= 0 and t0[E - 2] < 0 and (t0 >= 0).sum() == S
        assert t1[E - 1] >= 0 and t1[E - 2] < 0 and (t1 >= 0).sum() == S
        for layer in range(2, L):
            assert (cache.slot_of[layer] == before[layer]).all()
        for layer in (0, 1):  # the slot holds the new expert's weights, bytes of the store's
            moe = tier.params["layers"][layer]["moe"]
            slot = cache.slot_of[layer][E - 1]
            assert np.asarray(cache.pools[layer][0][slot]).tobytes() == np.asarray(moe["gate_up"][E - 1]).tobytes()
            assert np.asarray(cache.pools[layer][1][slot]).tobytes() == np.asarray(moe["down"][E - 1]).tobytes()
        assert np.asarray(d.tables[0]).tolist() == cache.slot_of[0].tolist()
        # every block may swap (no margin): the bytes stay resident decode's
        monkeypatch.setattr(staging, "ADAPT_Z", 0.0)
        monkeypatch.setattr(staging, "ADAPT_MAX_SWAPS", S)
        ids = res.encode(PROMPT)[:24]
        n = 40
        want = res.prefill(ids, "batch", 16, n_new=n + 1)
        got = tier.prefill(ids, "batch", 16, n_new=n + 1)
        first = int(np.argmax(np.asarray(want.logits)))
        wt, ws = res.greedy_decode(first, want.state, len(ids), n)
        d.reset_stats()
        gt, gs = tier.greedy_decode(first, got.state, len(ids), n)
        assert wt == gt
        names = digests.state_names(res.cfg)
        assert digests.first_diff([np.asarray(x) for x in jax.tree_util.tree_leaves(ws)],
                                   [np.asarray(x) for x in jax.tree_util.tree_leaves(gs)], names) is None
        assert d.stats()["pool_swaps"] > 0, d.stats()
        tier.tune(tier_adapt=False)  # off: the pools stay
        tier.use_expert_cache(S)
        frozen = [t.copy() for t in tier.runner.cache.slot_of]
        tier.greedy_decode(first, tier.prefill(ids, "batch", 16, n_new=n + 1).state, len(ids), n)
        assert all((a == b).all() for a, b in zip(frozen, tier.runner.cache.slot_of)) and tier.runner.direct.swaps == 0
        with pytest.raises(ValueError, match="tier_adapt must be on or off"):
            tier.tune(tier_adapt=2)
    finally:
        tier.tune(tier_decode="auto")
        tier.tune(tier_adapt=True)
        tier.use_expert_cache(None)


def test_direct_decode_compiles_each_block_graph_once(engines, monkeypatch):
    """Direct tier decode's greedy graphs (a full block, a shorter last one) compile once: later
    blocks, whose token arrives as the previous graph's output rather than from the host, and
    later decodes reuse them. (A second compile of the full block inside every decode cost the
    H200 more than half its decode time.)"""
    _direct_runs(engines[1])
    _, tier = engines
    tier.tune(tier_decode="direct")
    tier.tune(decode_block=4)
    try:
        tier.use_expert_cache(tier.cfg.top_k + 2)
        ids = tier.encode(PROMPT)[:12]
        pre = tier.prefill(ids, chunk=16, state=tier.new_state(64))
        _, state = tier.greedy_decode(5, pre.state, len(ids), 6)  # a full block, then a short one
        full, part = staging._DIRECT_GREEDY_FULL._cache_size(), staging._DIRECT_GREEDY._cache_size()
        pos = len(ids) + 6
        for n in (13, 4, 3):  # 3 full blocks and a short one; one full block; one short block
            toks, state = tier.greedy_decode(7, state, pos, n)
            assert len(toks) == n
            pos += n
        assert staging._DIRECT_GREEDY_FULL._cache_size() == full, "a full greedy block compiled again"
        assert staging._DIRECT_GREEDY._cache_size() == part, "a short greedy block compiled again"
    finally:
        tier.tune(tier_decode="auto", decode_block=16)
        tier.use_expert_cache(None)


def test_rebuilding_the_cache_frees_the_old_pools_first(engines, monkeypatch):
    """use_expert_cache drops every reference to the old cache (its pools) before it makes the
    new one: on a card sized for one set of pools, two at once would not fit."""
    _direct_runs(engines[1])
    import gc
    import weakref

    _, tier = engines
    for path in ("cache", "direct"):
        tier.tune(tier_decode=path)
        old = weakref.ref(tier.use_expert_cache(tier.cfg.top_k + 1))
        seen = []
        real_init = staging.ExpertCache.__init__

        def init(self, *a, **kw):
            gc.collect()
            seen.append(old() is None)
            real_init(self, *a, **kw)

        monkeypatch.setattr(staging.ExpertCache, "__init__", init)
        tier.use_expert_cache(tier.cfg.top_k + 1)
        monkeypatch.setattr(staging.ExpertCache, "__init__", real_init)
        assert seen == [True], (path, seen)
    tier.tune(tier_decode="auto")
    tier.use_expert_cache(None)


@pytest.mark.parametrize("name,field,value,msg", [
    ("BARO_TIER_DECODE", "tier_decode", "fast", "must be one of auto, cache, direct"),
    ("BARO_TIER_FETCH", "tier_fetch", "copy", "must be one of xla, dma"),
    ("BARO_TIER_ADAPT", "tier_adapt", "sometimes", "must be on or off")])
def test_tier_settings_are_checked(engines, monkeypatch, name, field, value, msg):
    """A bad tier setting is refused where it is given: in the environment before any weight is
    read (naming the variable), through tune() on a loaded engine (naming the setting), which
    keeps its settings."""
    _, tier = engines
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} {msg}"):
        baro_jax.load("tiny", mode="tier", progress=False)
    monkeypatch.delenv(name)
    before = tier.settings
    with pytest.raises(ValueError, match=f"{field} " + ("must be True or False" if field == "tier_adapt" else msg)):
        tier.tune(**{field: value})  # an argument: on/off is a Python bool, not text
    assert tier.settings == before


def test_expert_cache_lru():
    """Hits, misses, eviction order (least recently used, never an expert the call needs), slot reuse,
    and the pool's slots holding exactly the store's experts (checked against a plain reference LRU)."""
    eng = baro_jax.load("tiny-random", mode="tier", backend="ordered", progress=False)
    cache = staging.ExpertCache(eng.cfg, eng.params["layers"], 3)
    cache.keep_events = True
    E = eng.cfg.num_experts
    seq = [[0, 1], [1, 2], [0, 3], [2, 4], [4, 2], [5, 6]]
    ref, ref_free, ref_slot = [], [0, 1, 2], {}
    for t, ids in enumerate(seq):
        n_ev = len(cache.events)
        slots = cache.ensure(1, np.asarray(ids, np.int32))
        exp_events = []
        for e in ids:  # hits refresh first
            if e in ref:
                ref.remove(e)
                ref.append(e)
        for e in ids:
            if e in ref_slot:
                continue
            if ref_free:
                s, old = ref_free.pop(0), -1
            else:
                old = ref.pop(0)
                s = ref_slot.pop(old)
            ref.append(e)
            ref_slot[e] = s
            exp_events.append((1, e, s, old))
        assert cache.events[n_ev:] == exp_events, (t, cache.events[n_ev:], exp_events)
        assert {e: int(slots[e]) for e in range(E) if slots[e] >= 0} == ref_slot, t
        assert all(e in ref_slot for e in ids)
        gu, dn = (np.asarray(a) for a in cache.pools[1])
        store = eng.params["layers"][1]["moe"]
        for e, s in ref_slot.items():
            assert gu[s].tobytes() == np.asarray(store["gate_up"][e]).tobytes(), (t, e, s)
            assert dn[s].tobytes() == np.asarray(store["down"][e]).tobytes(), (t, e, s)
    n = sum(len(set(i)) for i in seq)
    assert cache.hits + cache.misses == n and cache.misses == len(cache.events)
    assert cache.evictions == sum(1 for ev in cache.events if ev[3] >= 0)
    assert cache.slot_of[0].tolist() == [-1] * E  # other layers untouched
    with pytest.raises(ValueError, match="more than the cache's 3 slots"):
        cache.ensure(1, np.arange(4, dtype=np.int32))


def test_cache_sized_by_budget():
    """64 slots (at most E) by default; fewer when the budget says so; none below top_k. The room
    is what is left beside the reserved prefill (its chunk, its KV/state) and the runtime reserve."""
    import jax.numpy as jnp

    cfg = baro_jax.preset("tiny-random")
    S, note = budget.tier_cache_slots(cfg, jnp.bfloat16, None)
    assert S == min(64, cfg.num_experts), note
    chunk, L = budget.reserved_prefill(cfg)
    assert chunk == min(budget.PREFILL_RESERVE_CHUNK, cfg.max_context)
    base = budget.check_tier(cfg, jnp.bfloat16, None, L, chunk)
    per = budget.cache_bytes(cfg, jnp.bfloat16, 1)
    for want in (cfg.top_k, cfg.top_k + 1):
        gb = budget.budget_gb_for(base + want * per + 100)
        S, note = budget.tier_cache_slots(cfg, jnp.bfloat16, gb)
        assert S == want, note
        assert "the budget allows no more" in note
    gb = budget.budget_gb_for(base + (cfg.top_k - 1) * per + 100)
    S, note = budget.tier_cache_slots(cfg, jnp.bfloat16, gb)
    assert S == 0 and "no room for the cache" in note
    eng = baro_jax.load("tiny-random", mode="tier", backend="ordered", progress=False,
                        device_budget_gb=budget.budget_gb_for(base + 3 * per + 100))
    assert eng.cache_slots == 3
    with pytest.raises(MemoryError, match="decode expert cache 4 x 3 slots"):  # counted in every check
        eng.prefill(list(range(10)), chunk=8192)


def test_state_bytes_match_the_allocated_state():
    import dataclasses

    import jax
    import jax.numpy as jnp
    from baro_jax import model as M

    for rule in ("token", "blocked"):
        cfg = dataclasses.replace(baro_jax.preset("tiny-random"), delta_rule=rule)
        st = M.init_state(cfg, jnp.bfloat16, 256)
        real = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(st))
        assert budget.state_bytes(cfg, jnp.bfloat16, 256) == real, rule


def test_fetch_length_exact_then_powers_of_two():
    """A layer's misses are copied in one call: exactly the misses up to EXACT_FETCH_MAX (a
    decode token's, at most top_k), then a power-of-two length; never fewer copies than misses,
    never more than twice as many (the padding repeats a copy)."""
    from baro_jax.staging import EXACT_FETCH_MAX, fetch_length

    for n in range(1, 70):
        p = fetch_length(n)
        assert n <= p < 2 * n or p == n == 1, (n, p)
        if n <= EXACT_FETCH_MAX:
            assert p == n, (n, p)
        else:
            assert p & (p - 1) == 0, (n, p)
    assert [fetch_length(n) for n in (1, 3, 8, 10, 16, 17, 33)] == [1, 3, 8, 10, 16, 32, 64]
