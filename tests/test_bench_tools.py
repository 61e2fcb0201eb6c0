"""Small pieces of the bench scripts that decide what a report says."""
import numpy as np
import pytest

from benchmarks import decode_profile, sanitize_cover, throughput


def test_profile_groups_kernels_by_name_without_templates_or_namespaces():
    short = decode_profile.short
    conv = "void baro_gpu::(anonymous namespace)::conv_kernel<8, float>(float const*, unsigned short const*, long)"
    delta = "void baro_gpu::(anonymous namespace)::delta_kernel<128>(baro_gpu::DeltaDims, float const*)"
    assert short(conv) == "void baro_gpu::conv_kernel"
    assert short(delta) == "void baro_gpu::delta_kernel"  # two groups, not one 'void baro_gpu::'
    assert short("void baro_gpu::gemm_row1_kernel<true, 2, 1>(baro_gpu::GemmParams, long)") == \
        "void baro_gpu::gemm_row1_kernel"
    assert short("loop_add_fusion") == "loop_add_fusion"
    # --templates: a kernel's instances apart (the MoE's gathered gate/up GEMM, not the dense ones)
    wg = "void baro_gpu::gemm_wgmma_kernel<128, true, true, 4>(baro_gpu::GemmParams, baro_gpu::WgGemmMaps)"
    assert short(wg) == "void baro_gpu::gemm_wgmma_kernel"
    assert short(wg, templates=True) == "void baro_gpu::gemm_wgmma_kernel<128, true, true, 4>"
    assert short(conv, templates=True) == "void baro_gpu::conv_kernel<8, float>"


def test_profile_splits_devices_and_counts_their_collectives():
    """--devices N: each GPU plane on its own (overlapping kernels of two devices are not one
    device's busy time), NCCL kernels counted as the sharding's collective time."""
    g0, g1 = "/device:GPU:0", "/device:GPU:1"
    ks = [("void baro_gpu::gemm_row1_kernel<1>(x)", 0, 4000, g0),
          ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 4000, 9000, g0),
          ("void baro_gpu::gemm_row1_kernel<1>(x)", 1000, 3000, g1),
          ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 3000, 9000, g1),
          ("all-gather-start.3", 9000, 9500, g1)]
    d = decode_profile.per_device(ks, 2)
    assert set(d) == {g0, g1}
    assert d[g0]["busy_ms_per_step"] == 9000 / 1e6 / 2 and d[g0]["kernels_per_step"] == 1.0
    assert d[g0]["collective_ms_per_step"] == 5000 / 1e6 / 2 and d[g0]["collectives_per_step"] == 0.5
    assert d[g1]["busy_ms_per_step"] == 8500 / 1e6 / 2
    assert d[g1]["collective_ms_per_step"] == 6500 / 1e6 / 2 and d[g1]["collectives_per_step"] == 1.0
    assert not decode_profile.is_collective("void baro_gpu::moe_pairs_out_kernel(float const*)")


def test_graph_times_split_read_traces_kernels_at_the_host_waits():
    """row1_sweep's per-graph kernel times: read_trace's 4-field kernels (name, start, end,
    plane), only ours, split at gaps over 50 us; a wrong group count gives None."""
    g = "/device:GPU:0"
    ks = [("void baro_gpu::gemm_row1_kernel<1>(x)", 0, 3000, g),
          ("loop_add_fusion", 3000, 9000, g),  # not ours: neither counted nor a graph boundary
          ("void baro_gpu::gemm_row1_kernel<1>(x)", 10_000, 14_000, g),
          ("void baro_gpu::gemm_rows16_kernel<1>(x)", 120_000, 125_000, g),
          ("void baro_gpu::gemm_rows16_kernel<1>(x)", 126_000, 128_000, g)]
    assert decode_profile.graph_times_ns(ks, 2) == [7000, 7000]
    assert decode_profile.graph_times_ns(list(reversed(ks)), 2) == [7000, 7000]
    assert decode_profile.graph_times_ns(ks, 3) is None
    assert decode_profile.graph_times_ns(ks, 1, gap_ns=200_000) == [14000]


def test_sanitize_cover_counts_only_clean_runs_of_the_same_gpu_sources(tmp_path):
    """A shard covers its tests only when it ended clean (no hazard, no sanitizer-internal
    error) on a commit with the GPU sources checked; the tests nobody covered are listed."""
    import json
    import subprocess
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=sanitize_cover.ROOT).stdout.strip()

    def shard(k, clean=True, internal=()):
        return {"k": f"({k}) and not test_vs_ops_xla", "hazards": 0 if clean else 1, "exit": 0 if clean else 86,
                "sanitizer_internal_errors": list(internal), "clean": clean and not internal}
    runs = {"tools": {"racecheck": {"shards": [
        shard("test_matmul[gpu"), shard("conv", clean=False), shard("norm", internal=["failure to track"])]}},
        "git": head}
    other = {"tools": {"racecheck": shard("small_ops")}, "git": "0" * 40}  # not a commit: not counted
    files = []
    for name, s in (("a", runs), ("b", other)):
        files.append(str(tmp_path / f"sanitize_racecheck_{name}.json"))
        json.dump(s, open(files[-1], "w"))
    out = tmp_path / "cover.json"
    assert sanitize_cover.main([*files, "--tools", "racecheck", "--json", str(out)]) == 1
    cover = json.load(open(out))["tools"]["racecheck"]
    missing = set(cover["missing"])
    assert not any("test_matmul[gpu" in t for t in missing)
    for k in ("conv", "norm", "small_ops"):
        assert any(k in t for t in missing), f"{k}: an unclean or other-source run was counted"
    assert cover["covered"] == 5  # test_matmul[gpu-1, 2, 5, 64, 300]


def test_throughput_bound_counts_distinct_experts_and_states():
    """The byte bound of a decode step: B rows picking k of E experts touch E(1 - (1 - k/E)^B)
    of them (k alone, all E in the limit); the step's bytes grow with B by the experts, the delta
    states (read and written) and the KV, never below the weights without the routed experts."""
    de = throughput.distinct_experts
    assert de(256, 8, 1) == pytest.approx(8.0)
    assert de(256, 8, 8) == pytest.approx(57.42, abs=0.01)
    assert de(256, 8, 64) == pytest.approx(222.5, abs=0.1)
    assert de(256, 8, 10_000) == pytest.approx(256.0)
    import baro_jax

    eng = baro_jax.load("tiny", progress=False)
    b1, b8 = (throughput.decode_bound(eng, B, 100, 1.0) for B in (1, 8))
    assert b1["bytes_per_step"] < b8["bytes_per_step"] < 8 * b1["bytes_per_step"]
    assert b8["tokens_per_s"] == pytest.approx(8 * 1e12 / b8["bytes_per_step"])
    assert throughput.decode_bound(eng, 1, 100, 2.0)["step_ms"] == pytest.approx(b1["step_ms"] / 2)


def test_throughput_tier_row_counts_the_direct_path(tmp_path):
    """In tier mode a batch of one decodes in steps of one row on the direct path: the row counts
    them (direct_path) beside the cache's counts, and the sequence equals its run alone."""
    import json

    import baro_jax

    # a GPU's MoE cannot read the tiny model's experts from the host: no direct path there
    has_direct = baro_jax.load("tiny", mode="tier", progress=False).runner.direct is not None

    out = tmp_path / "t.json"
    assert throughput.main(["--model", "tiny", "--mode", "tier", "--batches", "1", "--prompt-len", "12",
                            "--new-tokens", "5", "--chunk", "16", "--check", "1", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["equal_alone"] == [True]
    d = row["direct_path"]
    if not has_direct:
        assert d is None  # every step on the cache path
        return
    assert d["pool_row_steps"] == 4 and d["hits"] + d["misses"] > 0, d  # 5 tokens: 4 decode steps


def test_throughput_mixed_row_reports_the_pace_beside_the_gaps(tmp_path):
    """The mixed-load row: long prompts prefill while short ones decode; every sequence's tokens
    reach the callback, and each sequence's mean time per token is reported beside the gaps."""
    import json

    out = tmp_path / "t.json"
    assert throughput.main(["--model", "tiny", "--batches", "2", "--prompt-len", "12", "--new-tokens", "9",
                            "--mixed", "1:40", "--chunk", "16", "--check", "1", "--json", str(out)]) == 0
    mixed = json.loads(out.read_text())["mixed"]
    assert mixed["generated_tokens"] == 3 * 9
    assert 0 < mixed["ms_per_token_p50"] <= mixed["ms_per_token_p99"]
    assert mixed["gap_ms_p50"] <= mixed["gap_ms_p99"]
    # N:LEN:B: B decoding sequences, not the largest batch
    assert throughput.main(["--model", "tiny", "--batches", "2", "--prompt-len", "12", "--new-tokens", "9",
                            "--mixed", "1:40:1", "--chunk", "16", "--check", "0", "--json", str(out)]) == 0
    mixed = json.loads(out.read_text())["mixed"]
    assert (mixed["decoding"], mixed["arriving"], mixed["generated_tokens"]) == (1, 1, 2 * 9)
    with pytest.raises(SystemExit):
        throughput.main(["--model", "tiny", "--mixed", "1:40:0"])


def test_throughput_rollout_row_times_shared_and_separate_prefill_with_the_same_bytes(tmp_path):
    """--rollouts P:K: K samples of each of P prompts, the prompt prefilled once (n=K) and once per
    sample; the arms give the same ids and logprob bytes, the shared one copies K - 1 states a
    prompt and runs a K-th of the chunks."""
    import json

    out = tmp_path / "t.json"
    assert throughput.main(["--model", "tiny", "--batches", "1", "--prompt-len", "40", "--new-tokens", "5",
                            "--rollouts", "2:3", "--chunk", "16", "--check", "0", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["rollouts"]
    assert r["arms_equal"] is True and (r["prompts"], r["samples"]) == (2, 3)
    sh, sep = r["shared"], r["separate"]
    assert sh["steps"]["forks"] == 4 and sep["steps"]["forks"] == 0
    assert sep["steps"]["prefill"] == 3 * sh["steps"]["prefill"] == 3 * 2 * 3
    assert sh["generated_tokens"] == sep["generated_tokens"] == 2 * 3 * 5
    with pytest.raises(SystemExit):
        throughput.main(["--model", "tiny", "--rollouts", "2:0"])


def test_profile_of_a_prefill_counts_its_calls_per_prompt(tmp_path):
    """--prefill: the "step" is a whole prompt's batched prefill; the JSON says so, with its chunk,
    tokens per second by the prompt's length, and each chunk's kernels counted once per prompt."""
    import json

    out = tmp_path / "p.json"
    decode_profile.main(["--model", "tiny", "--prefill", "--context", "40", "--chunk", "16", "--steps", "2",
                         "--top", "3", "--json", str(out)])
    d = json.loads(out.read_text())
    s = d["summary"]
    assert s["prefill"] is True and s["chunk"] == 16 and s["steps"] == 2
    assert abs(s["tok_per_s"] - 40 * 1e3 / s["median_step_ms"]) < 1e-6 * s["tok_per_s"]
    assert d["kernels"] and all(r["per_step"] > 0 for r in d["kernels"])
    # 40 tokens at chunk 16 are 3 chunk calls: the busiest group runs a whole number of times per chunk
    assert any(abs(r["per_step"] - round(r["per_step"])) < 1e-9 and round(r["per_step"]) % 3 == 0
               for r in d["kernels"]), d["kernels"][:5]


def test_profile_refuses_prefill_with_decode_only_options():
    for extra in (["--batch", "2"], ["--per-token"], ["--chunk", "16"]):
        args = ["--model", "tiny"] + extra + (["--prefill"] if extra[0] != "--chunk" else [])
        with pytest.raises(SystemExit):
            decode_profile.main(args)


def test_profile_of_a_sampled_batch_step_draws_in_the_block(tmp_path):
    """--batch with --temperature / --top-p: the rows draw inside the decode block (the profile's
    step is a sampled pool's), the JSON says how; sampling without --batch, or filters without a
    temperature, are refused."""
    import json

    out = tmp_path / "s.json"
    common = ["--model", "tiny", "--batch", "2", "--context", "12", "--steps", "16", "--warmup", "0", "--top", "3"]
    decode_profile.main(common + ["--temperature", "0.8", "--top-p", "0.9", "--json", str(out)])
    d = json.loads(out.read_text())
    s = d["summary"]
    assert s["batch"] == 2 and s["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9}
    assert s["median_step_ms"] > 0
    # top_p without a top_k ranks each row whole: the step holds a sort (XLA CPU's thunk), a greedy one none
    assert any(r["kernel"].startswith("sort") for r in d["kernels"]), [r["kernel"] for r in d["kernels"]]
    decode_profile.main(common + ["--json", str(out)])
    assert not any(r["kernel"].startswith("sort") for r in json.loads(out.read_text())["kernels"])
    for bad in (["--temperature", "0.8"], ["--batch", "2", "--top-p", "0.9"], ["--batch", "2", "--temperature", "-1"]):
        with pytest.raises(SystemExit):
            decode_profile.main(["--model", "tiny"] + bad)


def test_throughput_gives_no_decode_rate_for_waves(tmp_path):
    """A decode rate is B sequences decoding together: where the prefill budget lets the first
    sequences finish before the last one starts (4 prompts of 40 tokens at 16 prompt tokens a
    round, 3 new tokens each), the row says waves and gives no rate; together, it gives one."""
    import json

    out = tmp_path / "t.json"
    assert throughput.main(["--model", "tiny", "--batches", "4", "--prompt-len", "40", "--new-tokens", "3",
                            "--chunk", "16", "--prefill-budget", "16", "--check", "0", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["waves"] is True and row["decode_tokens_per_s"] is None
    assert row["aggregate_tokens_per_s"] > 0
    assert throughput.main(["--model", "tiny", "--batches", "2", "--prompt-len", "12", "--new-tokens", "9",
                            "--chunk", "16", "--check", "0", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["waves"] is False and row["decode_tokens_per_s"] > 0


def test_throughput_samples_each_sequence_with_its_own_seed_and_checks_it_alone(tmp_path):
    """--temperature: sequence i samples with seed i, the sampled pool runs in device blocks (fewer
    decode calls than steps), the sequences checked alone are equal, and the JSON says how it
    sampled; a bad setting is refused before the model loads."""
    import argparse
    import json

    out = tmp_path / "t.json"
    assert throughput.main(["--model", "tiny", "--batches", "3", "--prompt-len", "12", "--new-tokens", "9",
                            "--chunk", "16", "--check", "3", "--temperature", "1.0", "--top-k", "5",
                            "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    row = got["rows"][0]
    assert row["equal_alone"] == [True, True, True]
    assert row["steps"]["decode_calls"] < row["steps"]["decode"], row["steps"]
    assert got["summary"]["samplings"] == {"given": {"temperature": 1.0, "top_k": 5, "top_p": 1.0}}
    assert row["sampling"] == "given"
    s = throughput.sampling_of((0.5, 0, 1.0), 3)
    assert [x.seed for x in s] == [0, 1, 2] and all(x.temperature == 0.5 for x in s)
    with pytest.raises(SystemExit):
        throughput.main(["--model", "tiny", "--batches", "1", "--temperature", "-1"])


def test_throughput_runs_several_sampling_arms_on_one_load(tmp_path):
    """--samplings: each arm a row per batch size on the same prompts, each checked alone; the
    greedy arm's rows equal a run of its own; malformed arms are refused before the model loads."""
    import json

    out, one = tmp_path / "t.json", tmp_path / "g.json"
    common = ["--model", "tiny", "--batches", "1,2", "--prompt-len", "12", "--new-tokens", "7", "--chunk", "16",
              "--check", "2"]
    assert throughput.main(common + ["--samplings", "greedy=0,0,1;topp=0.9,0,0.8;wide=1.1,70,1", "--json",
                                     str(out), "--png", str(tmp_path / "t.png")]) == 0
    got = json.loads(out.read_text())
    assert [(r["sampling"], r["batch"]) for r in got["rows"]] == [(a, b) for a in ("greedy", "topp", "wide")
                                                                   for b in (1, 2)]
    assert all(r["equal_alone"] == [True] * r["batch"] for r in got["rows"])
    assert got["summary"]["samplings"]["topp"] == {"temperature": 0.9, "top_k": 0, "top_p": 0.8}
    assert (tmp_path / "t.png").stat().st_size > 0
    assert throughput.main(common + ["--json", str(one)]) == 0
    alone = json.loads(one.read_text())["rows"]
    assert [r["generated_tokens"] for r in alone] == [r["generated_tokens"] for r in got["rows"][:2]]
    for bad in ("greedy", "a=1,2", "a=x,0,1", "a=1,0,1;a=0,0,1", "a=-1,0,1"):
        with pytest.raises(SystemExit):
            throughput.main(["--model", "tiny", "--samplings", bad])


def test_throughput_records_a_batch_the_device_cannot_hold_and_goes_on(tmp_path):
    """A batch size whose slots do not fit the device budget is refused before any work: its row
    says why (MemoryError), the other rows still run and the JSON and plot are written, and the
    run reports failure."""
    import json

    import jax.numpy as jnp
    import numpy as np

    import baro_jax
    from baro_jax import budget

    cfg = baro_jax.load("tiny", progress=False).cfg
    gb = next(float(g) for g in np.linspace(0.05, 4.0, 4000)
              if 2 <= budget.batch_slots(cfg, jnp.bfloat16, float(g), 1024, 16, 8)[0] < 8)
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = throughput.main(["--model", "tiny", "--batches", "1,8", "--prompt-len", "12", "--new-tokens", "3",
                          "--chunk", "16", "--check", "1", "--device-budget-gb", str(gb), "--json", str(out),
                          "--png", str(png)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 1 and png.exists()
    assert rows[0]["batch"] == 1 and rows[0]["equal_alone"] == [True] and "error" not in rows[0]
    assert rows[1]["batch"] == 8 and rows[1]["error"].startswith("MemoryError: max_batch 8 slots"), rows[1]


def test_speed_runs_the_peer_at_its_own_lengths(tmp_path):
    """--peer-lengths: ours at every --lengths, the peer only at its own (its memory at 128k);
    a length the peer skipped has no peer-hf entry and no ratio, one it ran but lacks says so,
    and a peer length outside --lengths is refused."""
    import json

    from benchmarks import speed

    peer = tmp_path / "peer.json"
    peer.write_text(json.dumps({"summary": {"arm": "peer-hf"},
                                "rows": [{"prompt_tokens": 16, "peer-hf": {"tokens_per_s": 1000.0}}]}))
    out = tmp_path / "s.json"
    common = ["--model", "tiny-random", "--lengths", "16,48", "--arms", "batch-ordered", "--chunk", "16",
              "--decode-tokens", "2", "--peer-json", str(peer), "--json", str(out)]
    assert speed.main(common + ["--peer-lengths", "16"]) == 0
    rows = {r["prompt_tokens"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[16]["ratio_vs_peer"] == rows[16]["batch-ordered"]["tokens_per_s"] / 1000.0
    assert "peer-hf" not in rows[48] and "ratio_vs_peer" not in rows[48]
    assert speed.main(common) == 0
    rows = {r["prompt_tokens"]: r for r in json.loads(out.read_text())["rows"]}
    assert "missing" in rows[48]["peer-hf"] and "ratio_vs_peer" not in rows[48]
    with pytest.raises(SystemExit):
        speed.main(common + ["--peer-lengths", "16,32"])


def test_k_segments_probe_times_each_segment_count_over_the_same_weight_bytes(tmp_path):
    """Each row of the probe is one GEMM of the layer at S segments: S N / 8 chains of K / S / 16
    steps over the weight bytes of the unsegmented call; an S that does not divide K / 16 is
    skipped, not timed on a wrong shape; --warm adds one unsegmented row a GEMM with one weight."""
    import json

    from benchmarks import k_segments_probe

    out = tmp_path / "k.json"
    # tiny-random's router has K = 64: 4 k16 steps, so S = 8 leaves a segment of 8 columns
    assert k_segments_probe.main(["--model", "tiny-random", "--m", "2", "--segments", "1,4,8", "--calls", "2",
                                  "--reps", "1", "--bandwidth-tbs", "1.0", "--warm", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    warm = [r for r in rows if r["weights"] == "one"]
    assert len(warm) == 4 and all(r["segments"] == 1 for r in warm)
    rows = [r for r in rows if r["weights"] == "distinct"]
    names = {r["gemm"] for r in rows}
    assert names == {"gdn_out_proj", "attn_o_proj", "router", "gdn_in_proj"}
    for r in rows:
        assert r["K"] % (16 * r["segments"]) == 0
        assert r["chains"] == r["segments"] * r["N"] // 8 and r["chain_steps"] * 16 * r["segments"] == r["K"]
        assert r["weight_mb"] == 2 * r["N"] * r["K"] / 1e6 and r["us_per_call"] > 0
        assert r["byte_bound_us"] == r["weight_mb"]  # at 1 TB/s, a MB is a microsecond
    assert not any(r["gemm"] == "router" and r["segments"] == 8 for r in rows)
    assert {r["segments"] for r in rows if r["gemm"] == "router"} == {1, 4}


@pytest.mark.parametrize("args, named", [(["--segments", "0"], "--segments"), (["--m", "8,x"], "--m"),
                                         (["--calls", "0"], "--calls"), (["--bandwidth-tbs", "-1"], "--bandwidth-tbs")])
def test_k_segments_probe_refuses_bad_arguments_by_name(args, named, capsys):
    from benchmarks import k_segments_probe

    with pytest.raises(SystemExit) as e:
        k_segments_probe.main(["--model", "tiny-random"] + args)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_run_gpu_usage_lists_every_stage_it_defines():
    """run_gpu.sh's usage line is where a reader finds the stages: it names each stage_<name>
    function, and nothing that is not one (a name there without a function fails as a stage)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "run_gpu.sh").read_text()
    defined = set(re.findall(r"^stage_(\w+)\(\)", text, re.M))
    usage = set(re.search(r"\(stages: ([^)]*)\)", text).group(1).split())
    assert defined - usage == set() and usage - defined == set()


def test_prefill_host_times_engine_prefills_own_calls(tmp_path):
    """prefill_host.py replays Engine.prefill's batched path call by call: the same last logits
    (bytes) as Engine.prefill, every host phase timed, the first chunk's apart from the later ones."""
    import json

    import baro_jax
    from baro_jax.runner import state_length
    from benchmarks import prefill_host

    eng = baro_jax.load("tiny", backend="auto", progress=False)
    ids = list(range(3, 40))
    L = state_length(len(ids), eng.cfg.max_context)
    ref = eng.prefill(ids, "batch", 16)
    for jnp_inputs in (False, True):
        t, wall, logits = prefill_host.phases(eng, ids, 16, L, jnp_inputs=jnp_inputs)
        assert np.asarray(logits).tobytes() == np.asarray(ref.logits).tobytes()
        assert set(t) == {"check_ids", "check_fits_device", "new_state", "first_chunk", "later_chunks", "wait"}
        assert all(v >= 0 for v in t.values()) and sum(t.values()) <= wall + 1e-6
    out = tmp_path / "host.json"
    prefill_host.main(["--model", "tiny", "--length", "40", "--chunk", "16", "--repeats", "1", "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["summary"]["chunk"] == 16 and d["summary"]["length"] == 40 and len(d["phase_ms"]) == 1
    assert d["summary"]["host_ms_before_first_kernels"] < d["summary"]["median_wall_ms"]
    assert len(d["phase_ms_jnp_inputs"]) == 1 and d["summary"]["median_wall_ms_jnp_inputs"] > 0
