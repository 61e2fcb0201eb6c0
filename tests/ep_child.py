"""Child process of test_expert_parallel.py: N forced host devices must be set before jax starts."""
import os
import sys

N = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import baro_jax  # noqa: E402
from baro_jax import expert_parallel as EP  # noqa: E402
from baro_jax import verify  # noqa: E402
from baro_jax.verify import identity  # noqa: E402

GATE_PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "prompts", "identity.jsonl")

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n"
NEW = 4


def moe_hlo(eng):
    return jax.jit(eng.ops.moe, static_argnames="top_k").lower(
        jnp.zeros((3, eng.cfg.hidden_size), jnp.bfloat16), *(eng.params["layers"][0]["moe"][k] for k in
        ("router", "gate_up", "down", "shared_gate_up", "shared_down", "shared_gate")),
        top_k=eng.cfg.top_k).as_text()


def check_pairs_hlo(hlo, cfg, m=3):
    """The MoE really runs expert-parallel: the per-pair kernel on each shard, ONE all-gather, of
    the [m, k, D] pair outputs in bf16 (the experts never move), no reducing collective."""
    gathers = [ln for ln in hlo.splitlines() if "all_gather" in ln or "all-gather" in ln]
    pairs = f"tensor<1x{m}x{cfg.top_k}x{cfg.hidden_size}xbf16>"
    assert len(gathers) == 1 and f"({pairs})" in gathers[0], gathers
    assert "baro_moe_pairs" in hlo and "baro_moe_combine" in hlo
    assert "all_reduce" not in hlo and "all-reduce" not in hlo and "reduce_scatter" not in hlo


def check_arms(many, model, ids, names, ref, label):
    arms = {"batch 16": ("batch", 16), "batch 7": ("batch", 7), "replay": ("replay", None)}
    for name, (mode, c) in arms.items():
        got = identity.run_arm(many, ids, mode, c, NEW)
        d = identity.first_diff(ref["state"], got["state"], names)
        assert d is None, (model, label, name, d)
        assert ref["logits"].tobytes() == got["logits"].tobytes(), (model, label, name)
        assert ref["tokens"] == got["tokens"], (model, label, name)
        print(f"OK {model} {label} {name}")


def main():
    assert len(jax.devices()) == N, jax.devices()
    for model in sys.argv[2:]:
        one = baro_jax.load(model, backend="ordered", progress=False)
        many = baro_jax.load(model, backend="ordered", progress=False, devices=N)
        assert isinstance(many.ops, EP.ExpertParallelOps) and many.devices == N
        gu = many.params["layers"][0]["moe"]["gate_up"]
        E = gu.shape[0]
        assert gu.sharding.spec == jax.sharding.PartitionSpec("e"), gu.sharding
        assert {s.data.shape[0] for s in gu.addressable_shards} == {E // N}
        hlo = moe_hlo(many)
        if N > 1:
            assert many.ops.pairs
            check_pairs_hlo(hlo, many.cfg)
        else:  # one device owns every expert: the one-device kernel, no collective
            assert not many.ops.pairs and "baro_moe_pairs" not in hlo
            assert "all-gather" not in hlo and "all_gather" not in hlo
            assert "baro_moe" in hlo
        ids = one.encode(PROMPT)
        names = identity.state_names(one.cfg)
        ref = identity.run_arm(one, ids, "batch", 16, NEW)
        check_arms(many, model, ids, names, ref, f"devices={N}")
        if N == 1:  # the per-pair kernels kept at N = 1 (BARO_EP_PAIRS=1) give the same bytes
            forced = EP.shard(baro_jax.load(model, backend="ordered", progress=False), 1, pairs=True)
            check_pairs_hlo(moe_hlo(forced), forced.cfg)
            check_arms(forced, model, ids, names, ref, "devices=1 pairs")
        # generate(): greedy decode in device blocks (a fori_loop around the sharded MoE)
        g1 = one.generate(PROMPT, 20, stop_at_eos=False).generated_ids
        gn = many.generate(PROMPT, 20, stop_at_eos=False).generated_ids
        assert g1 == gn and len(gn) == 20, (model, N, g1, gn)
        # each greedy block graph compiles once: a later block's token (the last graph's output,
        # placed on the mesh) and a first block's (from the host) take the same graph
        from baro_jax import runner as E

        st = many.prefill(ids, chunk=16, state=many.new_state(128)).state
        _, st = many.greedy_decode(5, st, len(ids), 18)  # a full block of 16, a short one
        sizes = (E.GREEDY_FULL._cache_size(), E.GREEDY._cache_size())
        toks, st = many.greedy_decode(7, st, len(ids) + 18, 37)  # two full blocks, a short one
        assert len(toks) == 37 and (E.GREEDY_FULL._cache_size(), E.GREEDY._cache_size()) == sizes, (model, N)
    # the identity gate with devices: batched == replay on N devices, and replay == one device's
    # (benchmarks/identity.py --devices N --reference-json ONE.json)
    one = baro_jax.load("tiny", backend="ordered", progress=False)
    prompts = verify.select(verify.load_prompts(GATE_PROMPTS, one.tokenizer), max_len=40)
    ref = verify.run_identity_gate(one, prompts, [16], new_tokens=4, log=None)
    assert ref.ok, [r for r in ref.rows if not identity.row_ok(r)]
    digests = {(r["prompt"], r["len"]): r["replay_digest"] for r in ref.rows}
    many = verify.run_identity_gate(lambda: baro_jax.load("tiny", backend="ordered", progress=False, devices=N),
                                    prompts, [16], new_tokens=4, reference=digests, log=None)
    assert many.ok and many.reference["prompts_compared"] == len(prompts), many.to_json()["summary"]
    print(f"OK identity gate devices={N} vs one device")
    # many sequences on N devices: each sequence of generate_batch (2 slots for 3 prompts, blocks
    # chained; one sampled with a temperature, one with a top_k, both drawn in the block graph) ==
    # one device's run alone, in ids and logprob bytes
    eng = baro_jax.load("tiny", backend="ordered", progress=False, devices=N)
    texts, news = [PROMPT, "import os\n", "x"], [18, 5, 9]
    sps = [baro_jax.Sampling(temperature=0.9, seed=4), baro_jax.Sampling(),
           baro_jax.Sampling(temperature=1.2, top_k=8, top_p=0.9, seed=2)]
    got = eng.generate_batch(texts, news, logprobs=0, max_batch=2, stop_at_eos=False, sampling=sps)
    for t, n, s, g in zip(texts, news, sps, got):
        a = one.generate(t, n, logprobs=0, stop_at_eos=False, sampling=s)
        assert a.generated_ids == g.generated_ids and \
            b"".join(x.tobytes() for x in a.logprobs) == b"".join(x.tobytes() for x in g.logprobs), (N, t)
    # two samples of one prompt on N devices: the second takes a copy of the first's prompt state
    # (the pool's FORK over sharded pages), each == one device's run alone at seed + j
    got = eng.generate_batch([PROMPT], 6, n=2, logprobs=0, max_batch=2, chunk=8, stop_at_eos=False,
                             sampling=sps[0])
    assert eng.last_batch_stats["steps"]["forks"] == 1, eng.last_batch_stats["steps"]
    for j, g in enumerate(got):
        a = one.generate(PROMPT, 6, logprobs=0, stop_at_eos=False,
                         sampling=baro_jax.Sampling(temperature=0.9, seed=4 + j))
        assert a.generated_ids == g.generated_ids and \
            b"".join(x.tobytes() for x in a.logprobs) == b"".join(x.tobytes() for x in g.logprobs), (N, j)
    # one sampled sequence alone on N devices (its draws inside the block graph) == one device's
    for s in sps[::2]:
        a = one.generate(PROMPT, 12, logprobs=0, stop_at_eos=False, sampling=s)
        g = eng.generate(PROMPT, 12, logprobs=None, stop_at_eos=False, sampling=s)
        assert a.generated_ids == g.generated_ids, (N, s)
    print(f"OK generate_batch devices={N} vs one device alone")


if __name__ == "__main__":
    main()
