#!/usr/bin/env bash
# The GPU runs, in stages: build, kernel tests, identity gates, op times, speed.
# Usage: OUT=dir bash benchmarks/run_gpu.sh STAGE...   (stages: build unrun kernels rows blocked blocked_mma sanitize tiny ops row1 probe full attn_wgmma gemm_wgmma ep1 ep2 longctx decode decode_knobs ncu_decode ncu_rows ncu_moe_prefill ncu_attn ncu_source mma_swap mma_latency wy_probe k_segments prefill_profile chunk_sweep delta_knobs attn_pipe pipe_order moe_grouped gdn_pack prefill_host tier tier_overlap tier_direct tier_profile host_probe speed peer vs_peer agreement batch batch_knobs batch_tier topk serve)
# Every stage logs to $OUT; a failing stage does not stop the later ones.
set -u
OUT=${OUT:-/tmp/baro_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export BARO_COMMIT=${BARO_COMMIT:-$(git rev-parse --verify HEAD 2>/dev/null)}
cd "$(dirname "$0")/.."
# Result files are named by the card that made them (h200, h100): numbers from two cards are never
# compared. JAX takes 75% of the card by default: on an H200 that holds the ~70 GB of full-size
# weights, on an 80 GB H100 it does not, so there the resident runs take 94% and the tier runs'
# "24 GB card" is 24 GiB of its memory (not 0.17 of it).
CARD=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200|a100|mi[0-9]+' | tr 'A-Z' 'a-z')}
CARD=${CARD:-gpu}
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ -n "$GPU_MIB" ] && [ "$GPU_MIB" -lt 100000 ]; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}
  TIER_MEM_FRACTION=${TIER_MEM_FRACTION:-$(python3 -c "print(round(24576 / $GPU_MIB, 3))")}
fi
case "$CARD" in h100) BANDWIDTH_TBS=${BANDWIDTH_TBS:-3.0} ;; *) BANDWIDTH_TBS=${BANDWIDTH_TBS:-4.3} ;; esac
# The full-size identity gates on an 80 GB H100: 97% of the card holds chunk 1024 beside 16k of
# context or 24 slots of 9,216 positions (2026-12-06); expanded as env ${GATE_ENV[@]+"${GATE_ENV[@]}"}.
GATE_ENV=(); [ "$CARD" = h100 ] && GATE_ENV=(XLA_PYTHON_CLIENT_MEM_FRACTION=0.97)
log() { echo "=== $(date +%T) $*" | tee -a "$OUT/stages.txt"; }
# One prefill of the product arm at LENGTHS under the env assignments given, checked against
# replay by speed.py (prefix and tail) into $OUT/JSON. SPEED_UNDER_CHUNK forces the chunk (the
# engine's own pick for an 8k prompt at 94% of an 80 GB H100 is 256).
# Usage: prefill_checked JSON TIMEOUT_S LENGTHS [NAME=VALUE...]
prefill_checked() {
  local json=$1 limit=$2 lengths=$3
  shift 3
  env "$@" timeout "$limit" python benchmarks/speed.py --model qwen3.5-35b-a3b --arms batch-ordered \
    --lengths "$lengths" --chunk "${SPEED_UNDER_CHUNK:-auto}" --decode-tokens 16 --check-tail 32 \
    --json "$OUT/$json" 2>&1 | grep -E "tok/s|identity|Error|error" | tail -3
}
# prefill_checked under each value of one speed knob (the same bits): $OUT/speed_<tag><value>_${CARD}.json.
# Usage: speed_under KNOB "VALUES" LENGTHS TAG [TIMEOUT_S]
speed_under() {
  local knob=$1 values=$2 lengths=$3 tag=$4 v
  for v in $values; do prefill_checked "speed_${tag}${v}_${CARD}.json" "${5:-240}" "$lengths" "$knob=$v"; done
}
# Each of SETTINGS (space-separated, each a comma-joined list of env assignments) by its index n
# from 0, for each part of PARTS: ops, OP's times at M rows (20 calls back to back, fastest of 3
# rounds; $OUT/op_times_<TAG>_<n>_$CARD.json); speed, a prefill at LENGTHS, identity-checked
# ($OUT/speed_<TAG>_<n>_$CARD.json). The settings go to $OUT/<LIST>.txt, numbered.
# Usage: sweep_settings "PARTS" OP TAG M LENGTHS LIST "SETTINGS"
sweep_settings() {
  local parts=$1 op=$2 tag=$3 m=$4 lengths=$5 list=$6 settings=$7 part setting n
  for part in $parts; do
    n=0
    for setting in $settings; do
      echo "--- $part $n: $setting"
      case $part in
        ops) env ${setting//,/ } timeout 120 python benchmarks/op_times.py --m "$m" --ops "$op" --backends ordered \
               --reps 20 --rounds 3 --json "$OUT/op_times_${tag}_${n}_${CARD}.json" 2>&1 | grep "op=" ;;
        speed) prefill_checked "speed_${tag}_${n}_${CARD}.json" 200 "$lengths" ${setting//,/ } ;;
      esac
      n=$((n + 1))
    done
  done
  echo "$settings" | tr ' ' '\n' | nl -v0 > "$OUT/${list}.txt"
}
stage_build() {
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  if [ -n "${BARO_LIB_DIR:-}" ]; then echo "using prebuilt libraries in $BARO_LIB_DIR"; export PYTHONPATH=$PWD; else
  BARO_GPU=cuda python -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; return 1; }; fi
  python -c "import custom_calls, jax; print(custom_calls.available_platforms(), jax.devices())"
}
stage_kernels() { timeout "${KERNELS_TIMEOUT:-420}" python -m pytest -m gpu tests/test_kernels_*.py -q --durations=8 ${KERNELS_K:+-k "$KERNELS_K"} 2>&1 | tee "$OUT/gpu_kernel_tests.txt" | tail -40; }
stage_rows() {  # the many-sequence kernels (attention over a KV pool per row, log_softmax): compiled, first GPU run
  timeout "${ROWS_TIMEOUT:-300}" python -m pytest -m gpu tests/test_kernels_attention_rows.py tests/test_kernels_logprob.py -q \
    --durations=8 2>&1 | tee "$OUT/gpu_rows_tests.txt" | tail -30
}
stage_blocked() {  # the chunk-aligned delta rule's CUDA kernel (compiled, first run on a GPU)
  timeout "${BLOCKED_TIMEOUT:-240}" python -m pytest -m gpu tests/test_delta_blocked.py -q 2>&1 | tee "$OUT/gpu_delta_blocked_tests.txt" | tail -30
}
# The blocked delta rule on the tensor cores (BARO_DELTA_BLOCKED_MMA=1, csrc/gpu/delta_blocked.cu;
# docs/PERF.md 2026-12-05: compiled, not run). Parts (BLOCKED_MMA_PARTS), each under one call's
# limit: tests (its byte tests, decode == prefill under the knob, and its values against a float64
# run of the blocked formulas; the CUDA-core instance, whose steps moved into shared device
# functions, is retested by the `blocked` stage), tiny (the identity gate
# on the tiny model with the knob on: the kernels inside the model's jitted graphs), speed (prefill at
# BLOCKED_MMA_LENGTHS for each arm of BLOCKED_MMA_ARMS: token = the per-token default, blocked0 /
# blocked1 = the blocked rule with the knob off / on; every arm identity-checked by speed.py's
# prefix replay and a 100-token tail replay that crosses block closes:
# speed_delta_<arm>_${CARD}.json), gate (the identity gate at full size with the knob on), ops (one
# layer's delta op, per-token and blocked, with the knob off and on, at BLOCKED_MMA_M rows), ncu (ncu's
# source counters of the tensor-core kernel at those rows: where its warps wait). The next
# GPU run, after `build`, four calls of at most ~9 minutes each:
#   OUT=dir bash benchmarks/run_gpu.sh blocked
#   OUT=dir BLOCKED_MMA_PARTS=tests bash benchmarks/run_gpu.sh blocked_mma
#   OUT=dir BLOCKED_MMA_PARTS="tiny speed" BLOCKED_MMA_ARMS=blocked1 bash benchmarks/run_gpu.sh blocked_mma
#   OUT=dir BLOCKED_MMA_PARTS=speed BLOCKED_MMA_ARMS="token blocked0" bash benchmarks/run_gpu.sh blocked_mma
stage_blocked_mma() {
  local part arm envs
  for part in ${BLOCKED_MMA_PARTS:-tests tiny speed}; do
    log "blocked_mma part $part"
    case $part in
      tests) timeout "${BLOCKED_MMA_TIMEOUT:-540}" python -m pytest -m gpu tests/test_delta_blocked_mma.py \
               -q --durations=8 -p no:cacheprovider 2>&1 | tee "$OUT/gpu_delta_blocked_mma_tests_${CARD}.txt" | tail -30 ;;
      speed) for arm in ${BLOCKED_MMA_ARMS:-token blocked0 blocked1}; do
               case $arm in
                 token) envs="BARO_DELTA=token" ;;
                 blocked0) envs="BARO_DELTA=blocked BARO_DELTA_BLOCKED_MMA=0" ;;
                 blocked1) envs="BARO_DELTA=blocked BARO_DELTA_BLOCKED_MMA=1" ;;
                 *) echo "blocked_mma: unknown arm $arm"; continue ;;
               esac
               echo "--- $arm ($envs)"
               env $envs timeout "${BLOCKED_MMA_SPEED_TIMEOUT:-250}" python benchmarks/speed.py --model qwen3.5-35b-a3b \
                 --arms batch-ordered --lengths "${BLOCKED_MMA_LENGTHS:-8192,32768}" --chunk auto --decode-tokens 16 \
                 --check-tail 100 --json "$OUT/speed_delta_${arm}_${CARD}.json" 2>&1 | grep -E "tok/s|Error|error" | tail -4
             done ;;
      ops) for arm in blocked0 blocked1; do  # one layer's op at BLOCKED_MMA_M rows: where the prefill gap sits
             env BARO_DELTA_BLOCKED_MMA=${arm#blocked} timeout 150 python benchmarks/op_times.py --m "${BLOCKED_MMA_M:-8192}" \
               --ops delta,delta_blocked --backends ordered --reps 5 --rounds 3 \
               --json "$OUT/op_times_delta_blocked_mma${arm#blocked}_${CARD}.json" 2>&1 | grep "op="
           done ;;
      ncu) BARO_DELTA_BLOCKED_MMA=1 NCU_SRC_KERNEL=delta_blocked_mma_kernel NCU_SRC_OPS=delta_blocked \
             NCU_SRC_M=${BLOCKED_MMA_M:-8192} NCU_SRC_TAG=delta_blocked_mma stage_ncu_source ;;
      tiny) BARO_DELTA=blocked BARO_DELTA_BLOCKED_MMA=1 timeout 200 python benchmarks/identity.py --model tiny \
              --chunks 7,16,37,64,100 --max-len 1100 --json "$OUT/identity_tiny_delta_blocked_mma_gpu.json" 2>&1 | tail -4 ;;
      gate) BARO_DELTA=blocked BARO_DELTA_BLOCKED_MMA=1 python benchmarks/identity.py --model qwen3.5-35b-a3b \
              --chunks "${BLOCKED_MMA_CHUNKS:-1024,8192}" --prompts benchmarks/prompts/identity_gpu.jsonl --max-context 16384 \
              --json "$OUT/identity_delta_blocked_mma_${CARD}.json" 2>&1 | tail -4 ;;
      *) echo "blocked_mma: unknown part $part" ;;
    esac
  done
}
# Written without a GPU and never run (2026-12-05): the byte tests of every opt-in kernel and of the
# paged pool's attention rows, in one pytest process (the shared-A stream, the persistent grouped
# rows16 schedule, the grouped wgmma prefill GEMMs, the tensor-core blocked delta rule and the
# CUDA-core one whose code moved, the paged attention_rows), then the pool tests on the GPU's default
# device. Run it first: a
# failure here says which knob's speed run to skip.
stage_unrun() {
  local files=${UNRUN_FILES-tests/test_kernels_matmul.py tests/test_kernels_moe.py tests/test_kernels_attention_rows.py tests/test_delta_blocked.py tests/test_delta_blocked_mma.py}
  [ -z "$files" ] || timeout "${UNRUN_TIMEOUT:-540}" python -m pytest -m gpu -q --durations=12 -p no:cacheprovider $files \
    -k "${UNRUN_K:-ashared or rows16_persist or moe_gemm_wgmma or attention_rows or blocked_mma or delta_blocked}" 2>&1 \
    | tee "$OUT/gpu_unrun_tests_${CARD}.txt" | tail -30
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${UNRUN_POOL_TIMEOUT:-360}" python -m pytest -q -p no:cacheprovider ${UNRUN_POOL_FILES:-tests/test_batch_paged.py tests/test_batch_mixed.py \
    tests/test_block_manager.py tests/test_batch_tier.py tests/test_batch.py tests/test_tier.py} 2>&1 | tee "$OUT/gpu_pool_tests_${CARD}.txt" | tail -8
}
stage_sanitize() { bash benchmarks/sanitize_gpu.sh 2>&1 | tail -30; }
stage_tiny() {
  python benchmarks/identity.py --model tiny --chunks 7,16,37,64 --max-len 1100 --json "$OUT/identity_tiny_gpu.json" 2>&1 | tail -6
}
stage_ops() { timeout "${OPS_TIMEOUT:-240}" python benchmarks/op_times.py --m "${OPS_M:-1,256,1024}" --backends "${OPS_BACKENDS:-ordered,xla}" --json "$OUT/op_times_${CARD}.json" 2>&1 | tail -30; }
# The decode GEMM's ring knobs at the model's decode shapes (benchmarks/row1_sweep.py).
# ROW1_ROWS rows per call (a decode step of that many sequences), ROW1_ARMS / ROW1_ENV_ARMS as the
# script's --arms / --env-arms, e.g. ROW1_ROWS=8 ROW1_ARMS="row1 default,nt2" ROW1_ENV_ARMS="k512:BARO_ROW1_KCHUNK=512".
stage_row1() {
  timeout "${ROW1_TIMEOUT:-300}" python benchmarks/row1_sweep.py --rows "${ROW1_ROWS:-1}" ${ROW1_ARMS:+--arms "$ROW1_ARMS"} \
    ${ROW1_ENV_ARMS:+--env-arms "$ROW1_ENV_ARMS"} --json "$OUT/row1_sweep_rows${ROW1_ROWS:-1}_${CARD}.json" 2>&1 | tail -40
}
# The few-row GEMMs of decode steps of many sequences (in_proj, out_proj, the MoE at NCU_ROWS_M rows): ncu's
# speed of light, memory workload (L2 and DRAM throughput) and warp stalls, one op_times process.
stage_ncu_rows() {
  # no preallocation: ncu saves and restores the memory a kernel may touch on every replay pass,
  # and XLA's default pool is most of the card (the first try spent 48 s on one kernel)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats -k "regex:gemm_" --launch-count "${NCU_ROWS_COUNT:-28}" \
    python benchmarks/op_times.py --m "${NCU_ROWS_M:-8,64}" --ops "${NCU_ROWS_OPS:-matmul gdn_in_proj,matmul gdn_out_proj,moe}" --reps 1 \
    --backends ordered > "$OUT/ncu_rows_${CARD}.txt" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Throughput|L2 Hit|Mem Busy|Max Bandwidth|Achieved Occupancy|Grid Size|Registers Per|Stall|Warp Cycles Per Issued" \
    "$OUT/ncu_rows_${CARD}.txt" | head -150
  pkill -f benchmarks/op_times.py; sleep 1  # a profiled child that outlived the timeout holds the card
}
# What holds the MoE's grouped prefill GEMMs (gemm_pipe_kernel: gate/up with the fused SwiGLU, then
# down) at NCU_MOE_M rows (4096; 8192 is the H200's chunk): one MoE call under ncu (the grid order
# of BARO_PIPE_ORDER as set), its two pipelined GEMMs with the tensor pipes' activity, issue stalls,
# occupancy and memory: $OUT/ncu_moe_prefill[_NCU_MOE_TAG]_${CARD}.txt (NCU_MOE_KERNELS: the kernel regex, NCU_MOE_COUNT launches).
stage_ncu_moe_prefill() {
  ncu_op_sections "$OUT/ncu_moe_prefill${NCU_MOE_TAG:+_$NCU_MOE_TAG}_${CARD}.txt" "${NCU_MOE_KERNELS:-gemm_pipe}" \
    "${NCU_MOE_COUNT:-2}" --m "${NCU_MOE_M:-4096}" --ops moe
}
# The prefill attention kernel at a 32k prompt's last 4k chunk (op_times.py puts the queries at
# the middle of NCU_ATTN_CONTEXT): whether its L2 reads (every 64-row tile reads its whole KV
# prefix), its tensor pipe or its own latency binds (the last, on an H100 at 176f568: docs/PERF.md
# 2026-12-07). $OUT/ncu_attn_wgmma_${CARD}.txt.
stage_ncu_attn() {
  ncu_op_sections "$OUT/ncu_attn_wgmma_${CARD}.txt" attn_wgmma 1 \
    --m "${NCU_ATTN_M:-4096}" --context "${NCU_ATTN_CONTEXT:-65536}" --ops attention
}
# ncu's summary sections (speed of light, compute and memory workload, scheduler and warp states,
# occupancy, launch, instructions) of COUNT launches of the kernels matching REGEX in one
# op_times.py call (ordered backend, one rep) with OP_TIMES_ARGS, into FILE; the headline lines shown.
# Usage: ncu_op_sections FILE REGEX COUNT OP_TIMES_ARGS...
ncu_op_sections() {
  local f=$1 regex=$2 count=$3
  shift 3
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats \
    -k "regex:$regex" --launch-count "$count" \
    python benchmarks/op_times.py "$@" --reps 1 --backends ordered > "$f" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Throughput|Pipe|Issue|Eligible|Warp Cycles|Occupancy|Registers Per|Stall|L2 Hit" \
    "$f" | head -80
  pkill -f benchmarks/op_times.py; sleep 1
}
# Where one kernel's warps wait, line by line of its SASS (ncu --section SourceCounters: warp stall
# samples per instruction): NCU_SRC_KERNEL (regex, delta_kernel) in one op_times call of NCU_SRC_OPS
# (delta) at NCU_SRC_M rows (4096), NCU_SRC_ARGS added to op_times.py's (e.g. "--context 65536" for
# the prefill attention: NCU_SRC_KERNEL=attn_wgmma NCU_SRC_OPS=attention NCU_SRC_TAG=attn).
# $OUT/ncu_source_<tag>_${CARD}.csv.gz (the source page, SASS) and .txt (ncu's summary sections),
# tag NCU_SRC_TAG (delta).
stage_ncu_source() {
  local tag=${NCU_SRC_TAG:-delta}
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --section SourceCounters \
    --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
    -k "regex:${NCU_SRC_KERNEL:-delta_kernel}" --launch-count 1 -f -o "/tmp/ncu_source_$tag" \
    python benchmarks/op_times.py --m "${NCU_SRC_M:-4096}" --ops "${NCU_SRC_OPS:-delta}" ${NCU_SRC_ARGS:-} --reps 1 \
    --backends ordered > "$OUT/ncu_source_${tag}_log.txt" 2>&1
  ncu -i "/tmp/ncu_source_$tag.ncu-rep" > "$OUT/ncu_source_${tag}_${CARD}.txt" 2>&1
  ncu -i "/tmp/ncu_source_$tag.ncu-rep" --page source --csv --print-source sass 2>/dev/null \
    | gzip > "$OUT/ncu_source_${tag}_${CARD}.csv.gz"
  grep -E "Duration|Issued Warp|Eligible|Warp Cycles|Stall|Occupancy|Registers Per" "$OUT/ncu_source_${tag}_${CARD}.txt" | head -30
  pkill -f benchmarks/op_times.py; sleep 1
}
# Whether mma.sync gives the same bits with its operands' roles swapped (W as the 16-row A, a
# step's tokens as the 8-wide B): the question a swapped-operand decode stream for 2 to 8 rows
# stands on (benchmarks/mma_swap_probe.cu, ~5 s): $OUT/mma_swap_probe_${CARD}.jsonl.
stage_mma_swap() {
  nvcc -O3 -std=c++17 --fmad=false -arch=sm_90 -Icsrc/gpu -Icsrc/common benchmarks/mma_swap_probe.cu \
    -o /tmp/mma_swap_probe 2>&1 | tail -5
  timeout 60 /tmp/mma_swap_probe | tee "$OUT/mma_swap_probe_${CARD}.jsonl" | tail -3
}
# Cycles per step of one fp32 accumulator chain, mma.sync and wgmma m64n{8,16,32}k16, with 1 to 8
# chains interleaved (benchmarks/mma_latency_probe.cu, ~5 s): the floor under a decode GEMM whose
# columns give fewer chains than the card has sub-partitions. $OUT/mma_latency_probe_${CARD}.jsonl.
stage_mma_latency() {
  nvcc -O3 -std=c++17 --generate-code=arch=compute_90a,code=sm_90a -Icsrc/gpu -Icsrc/common \
    benchmarks/mma_latency_probe.cu -o /tmp/mma_latency_probe 2>&1 | grep -v C7519 | tail -5
  timeout 60 /tmp/mma_latency_probe | tee "$OUT/mma_latency_probe_${CARD}.jsonl" | tail -30
}
# The WY form of the blocked delta rule outside the library (benchmarks/wy_chain_probe.cu: its
# sequential chain U = X - W S0, O and the close in 3xTF32 mma.sync, and the S0-free prep in two forms, one
# layer's 32 heads, each checked in float64) at WY_TOKENS, beside the per-token delta op at the same
# rows (op_times.py): whether a WY delta rule could beat the token scan before it is built.
# $OUT/wy_chain_probe_${CARD}.jsonl, $OUT/op_times_delta_wy_ref_${CARD}.json.
stage_wy_probe() {
  local n
  nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/wy_chain_probe.cu -o /tmp/wy_chain_probe 2>&1 | tail -5
  for n in ${WY_TOKENS:-8192 32768}; do timeout 120 /tmp/wy_chain_probe "$n"; done | tee "$OUT/wy_chain_probe_${CARD}.jsonl"
  timeout 120 python benchmarks/op_times.py --m "$(echo ${WY_TOKENS:-8192 32768} | tr ' ' ,)" --ops delta --backends ordered \
    --reps 5 --rounds 3 --json "$OUT/op_times_delta_wy_ref_${CARD}.json" 2>&1 | grep "op="
}
# ncu stall reasons of the decode kernels at m = 1 (benchmarks/profile_gpu.sh 1): ~3 min.
stage_ncu_decode() { timeout "${NCU_TIMEOUT:-300}" bash benchmarks/profile_gpu.sh 1 2>&1 | tail -80; }
stage_probe() {
  python - <<'PY' 2>&1 | tee "$OUT/probe.txt"
import time, numpy as np, jax, baro_jax
t = time.time(); eng = baro_jax.load("qwen3.5-35b-a3b", backend="ordered", max_context=8192)
jax.block_until_ready(eng.params); print(f"synthetic weights {time.time()-t:.1f}s")
ids = [int(x) for x in np.random.default_rng(0).integers(0, 256, 300)]
for mode, c in (("batch", 256), ("batch", 256), ("replay", None), ("replay", None)):
    r = eng.generate(ids, 16, prefill=mode, chunk=c)
    print(mode, c, f"prefill {r.prefill_seconds:.2f}s {r.prefill_tokens_per_s:.0f} tok/s decode {r.decode_tokens_per_s:.1f} tok/s", r.generated_ids[:8])
PY
}
# On an 80 GB H100 the weights leave room for chunks 256 and 1024 beside 16k of context (GATE_ENV;
# 48/48 there, 2026-12-06); the gate refuses a case that cannot fit before any work.
stage_full() {
  local chunks=256,1024,2048,8192
  [ "$CARD" = h100 ] && chunks=256,1024
  env ${GATE_ENV[@]+"${GATE_ENV[@]}"} python benchmarks/identity.py --model qwen3.5-35b-a3b \
    --chunks "${GATE_CHUNKS:-$chunks}" --prompts benchmarks/prompts/identity_gpu.jsonl \
    --max-context "${GATE_MAX_CONTEXT:-16384}" --json "$OUT/identity_qwen35_${CARD}.json" 2>&1 | tail -40
}
# The opt-in sm_90a prefill attention (BARO_ATTN_WGMMA=1, csrc/gpu/attention_wgmma.cu): the
# harness (benchmarks/wgmma_attention_check.cu: bytes against the default kernel and one decode
# call per row, and both kernels' times, outside the library), its byte test in the library
# against the default kernel and one-row decode calls, the other attention tests (the default
# path unchanged), the identity gate at full size with the knob (batched prefill on the wgmma
# kernel == replay on the decode kernel), then prefill speed at WGMMA_LENGTHS with and without
# the knob in one call, each length identity-checked. WGMMA_PARTS picks parts (probe: the
# instruction probe, benchmarks/wgmma_probe.cu, wgmma against mma.sync).
stage_attn_wgmma() {
  local part
  for part in ${WGMMA_PARTS:-check tests gate speed}; do
    log "attn_wgmma part $part"
    case $part in
      probe) nvcc -O3 -std=c++17 --fmad=false -DBARO_WGMMA=1 --generate-code=arch=compute_90a,code=sm_90a \
               -Icsrc/gpu -Icsrc/common benchmarks/wgmma_probe.cu -o /tmp/wgmma_probe 2>&1 | tail -5
             timeout 60 /tmp/wgmma_probe | tee "$OUT/wgmma_probe_${CARD}.jsonl" ;;
      check) # benchmarks/wgmma_attention_check.cu, built -c as the library is (its header says why)
             local f="-O3 -std=c++17 --fmad=false -Xcompiler=-fno-fast-math -Icsrc/gpu -Icsrc/common"
             nvcc $f -DBARO_WGMMA=1 --generate-code=arch=compute_90a,code=sm_90a -c csrc/gpu/attention_wgmma.cu \
                  -o /tmp/wg.o && nvcc $f "--generate-code=arch=compute_90,code=[compute_90,sm_90]" \
                  -c benchmarks/wgmma_attention_check.cu -o /tmp/chk.o && nvcc -arch=sm_90a /tmp/wg.o /tmp/chk.o \
                  -o /tmp/wgmma_attention_check 2>&1 | tail -5
             WGMMA_LOADS=1,0 timeout 120 /tmp/wgmma_attention_check "${BARO_COMMIT:0:7}" all \
               > "$OUT/wgmma_attention_check_${CARD}.jsonl"; echo "check rc=$?" | tee -a "$OUT/stages.txt"
             tail -3 "$OUT/wgmma_attention_check_${CARD}.jsonl" | cut -c1-400 ;;
      tests) timeout 300 python -m pytest -m gpu tests/test_kernels_*.py -q -k "attention" -p no:cacheprovider 2>&1 \
               | tee "$OUT/gpu_kernel_tests_attn_wgmma_${CARD}.txt" | tail -8 ;;
      gate) BARO_ATTN_WGMMA=1 python benchmarks/identity.py --model qwen3.5-35b-a3b --chunks "${WGMMA_CHUNKS:-1024,8192}" \
              --prompts benchmarks/prompts/identity_gpu.jsonl --max-context 16384 --json "$OUT/identity_attn_wgmma_${CARD}.json" 2>&1 | tail -4 ;;
      speed) speed_under BARO_ATTN_WGMMA "0 1" "${WGMMA_LENGTHS:-8192,32768}" attn_wgmma 240 ;;
      *) echo "attn_wgmma: unknown part $part" ;;
    esac
  done
}
# The sm_90a prefill GEMM (BARO_GEMM_WGMMA, csrc/gpu/gemm_wgmma.cu): its byte tests against the
# default kernel and one-row calls (first, under a short limit: a wrong mbarrier count would hang),
# prefill speed at GEMM_WGMMA_LENGTHS once per setting in GEMM_WGMMA_SETTINGS (in one call, each
# identity-checked: speed_gemm_wgmma<i>_${CARD}.json), and the identity gate at full size with
# GEMM_WGMMA_GATE_ENV. GEMM_WGMMA_PARTS picks parts. A setting of several knobs joins them with
# commas. The MoE's grouped GEMMs on wgmma (BARO_GEMM_WGMMA_GROUPED=down, =sorted) and the ring of 3
# stages (BARO_GEMM_WGMMA_RING=3), each against the default at 8k (docs/PERF.md 2026-12-06):
#   OUT=dir GEMM_WGMMA_PARTS="tests speed" GEMM_WGMMA_TEST_TIMEOUT=200 GEMM_WGMMA_LENGTHS=8192 \
#     GEMM_WGMMA_SETTINGS="BARO_GEMM_WGMMA_GROUPED=0 BARO_GEMM_WGMMA_RING=3 BARO_GEMM_WGMMA_GROUPED=down \
#       BARO_GEMM_WGMMA_GROUPED=sorted,BARO_GEMM_WGMMA_RING=3" bash benchmarks/run_gpu.sh build gemm_wgmma
stage_gemm_wgmma() {
  local part
  for part in ${GEMM_WGMMA_PARTS:-tests speed gate}; do
    log "gemm_wgmma part $part"
    case $part in
      tests) timeout "${GEMM_WGMMA_TEST_TIMEOUT:-150}" python -m pytest -m gpu tests/test_kernels_matmul.py tests/test_kernels_moe.py \
               -q -k "wgmma or small_rows" -p no:cacheprovider 2>&1 | tee "$OUT/gpu_kernel_tests_gemm_wgmma_${CARD}.txt" | tail -12 ;;
      speed) local n=0 setting
             for setting in ${GEMM_WGMMA_SETTINGS:-BARO_GEMM_WGMMA=0 BARO_GEMM_WGMMA=1}; do
               echo "--- $setting"
               env ${setting//,/ } timeout "${GEMM_WGMMA_SPEED_TIMEOUT:-240}" python benchmarks/speed.py --model qwen3.5-35b-a3b --arms batch-ordered \
                 --lengths "${GEMM_WGMMA_LENGTHS:-8192,32768}" --chunk auto --decode-tokens 16 --check-tail 32 \
                 --json "$OUT/speed_gemm_wgmma${n}_${CARD}.json" 2>&1 | grep -E "tok/s|Error|error" | tail -3
               n=$((n + 1))
             done ;;
      gate) env ${GEMM_WGMMA_GATE_ENV:-BARO_GEMM_WGMMA=1} python benchmarks/identity.py --model qwen3.5-35b-a3b --chunks "${GEMM_WGMMA_CHUNKS:-1024,8192}" \
              --prompts benchmarks/prompts/identity_gpu.jsonl --max-context 16384 --json "$OUT/identity_gemm_wgmma_${CARD}.json" 2>&1 | tail -4 ;;
      *) echo "gemm_wgmma: unknown part $part" ;;
    esac
  done
}
# Expert parallel with N = 1 (issue 14): the sharded path (baro_moe_pairs per shard, the all-gather,
# owner select, baro_moe_combine) through the identity gate at full size, batched == replay.
stage_ep1() {
  [ "${EP_GATE:-1}" = 0 ] || python benchmarks/identity.py --model qwen3.5-35b-a3b --devices 1 --chunks "${EP_CHUNKS:-1024,8192}" \
    --prompts benchmarks/prompts/identity_gpu.jsonl --max-context 16384 --json "$OUT/identity_ep1_${CARD}.json" 2>&1 | tail -6
  # speed beside the one-device engine, each identity-checked (EP_SPEED=0: the gate only; EP_GATE=0: the speed only)
  # ep1: the sharded engine on a one-device mesh (the one-device MoE kernel); ep1pairs: the same
  # with BARO_EP_PAIRS=1, the per-pair kernels N > 1 runs, less their all-gather's transport
  [ "${EP_SPEED:-1}" = 1 ] && for arm in ${EP_ARMS:-one ep1 ep1pairs}; do
    local n=1; [ "$arm" = one ] && n=""
    BARO_EP_PAIRS=$([ "$arm" = ep1pairs ] && echo 1 || echo 0) \
      ep_speed qwen3.5-35b-a3b "$n" "$OUT/speed_${arm}_device_${CARD}.json" 200
  done
}
# ep_speed MODEL N JSON TIMEOUT: prefill + decode at EP_LENGTHS on N devices (N empty: the
# one-device engine), each length identity-checked
ep_speed() {
  local dv=(); [ -n "$2" ] && dv=(--devices "$2")
  timeout "$4" python benchmarks/speed.py --model "$1" --arms batch-ordered ${dv[@]+"${dv[@]}"} \
    --lengths "${EP_LENGTHS:-1024,8192}" --chunk auto --decode-tokens 32 --check-tail 32 \
    --json "$3" 2>&1 | grep -E "tok/s|Error|error" | tail -3
}
# Expert parallel on two GPUs (issue 14; the nvidia-h200-x2 kind), in parts that each fit a call
# (EP2_PARTS, default all, in this order):
#   ref       the one-device identity gate at full Qwen3.5-35B-A3B (its digests are the reference)
#   gate      the same gate on EP2_DEVICES (2) devices, checked against ref: N devices == one device
#   speed     prefill + decode beside one device, each identity-checked
#   big_gate  Qwen3-Next-80B-A3B (real widths, does not fit one card): identity within 2 devices
#   big_speed its prefill + decode speed
#   profile   decode_profile on 2 devices: per-GPU busy time and NCCL time
# EP2_MODEL / EP2_BIG_MODEL / EP2_PROMPTS / EP2_MAX_LEN / EP2_MAX_CONTEXT exist for a CPU dry run with tiny models.
stage_ep2() {
  local m=${EP2_MODEL:-qwen3.5-35b-a3b} big=${EP2_BIG_MODEL:-qwen3-next-80b-a3b} n=${EP2_DEVICES:-2}
  local gate=(--chunks "${EP_CHUNKS:-1024,8192}" --prompts "${EP2_PROMPTS:-benchmarks/prompts/identity_gpu.jsonl}"
              --max-len "${EP2_MAX_LEN:-0}" --max-context "${EP2_MAX_CONTEXT:-16384}")
  local ref="$OUT/identity_one_device_ref_${CARD}.json" part
  for part in ${EP2_PARTS:-ref gate speed big_gate big_speed profile}; do
    log "ep2 part $part"
    case $part in
      ref) python benchmarks/identity.py --model "$m" "${gate[@]}" --json "$ref" 2>&1 | tail -3 ;;
      gate) python benchmarks/identity.py --model "$m" --devices "$n" "${gate[@]}" --reference-json "$ref" \
              --json "$OUT/identity_ep${n}_${CARD}.json" 2>&1 | tail -4 ;;
      speed) ep_speed "$m" "" "$OUT/speed_one_x${n}_${CARD}.json" 240
             ep_speed "$m" "$n" "$OUT/speed_ep_x${n}_${CARD}.json" 240 ;;
      big_gate) python benchmarks/identity.py --model "$big" --devices "$n" "${gate[@]}" \
                  --json "$OUT/identity_ep${n}_qwen3next_${CARD}.json" 2>&1 | tail -4 ;;
      big_speed) ep_speed "$big" "$n" "$OUT/speed_ep${n}_qwen3next_${CARD}.json" 300 ;;
      profile) timeout 240 python benchmarks/decode_profile.py --model "$big" --devices "$n" --context "${EP2_CONTEXT:-8192}" \
                 --steps 32 --top 16 --json "$OUT/decode_profile_ep${n}_qwen3next_${CARD}.json" 2>&1 | grep -v '^\[baro_jax\]' | tail -24 ;;
      *) echo "ep2: unknown part $part" ;;
    esac
  done
}
# Long-context identity (issue 10): a 64k (then 128k) prompt, batched at the default chunk and 4096
# vs replay, bytes of every state leaf, last logits, 32 greedy tokens; a replay that would end past
# LONGCTX_DEADLINE_S is recorded as skipped with its estimate. $OUT/identity_longctx_${CARD}.json.
# 128k in two calls on a warm machine: LONGCTX_LENGTHS=131072 LONGCTX_ARGS="--replay-stop 65536
# --replay-save /tmp/lc" for the first, LONGCTX_ARGS="--replay-resume /tmp/lc" for the second.
stage_longctx() {
  timeout "${LONGCTX_TIMEOUT:-590}" python benchmarks/identity_longctx.py --model qwen3.5-35b-a3b \
    --lengths "${LONGCTX_LENGTHS:-65536,131072}" --chunks "${LONGCTX_CHUNKS:-default,4096}" --new-tokens 32 \
    --deadline-s "${LONGCTX_DEADLINE_S:-540}" ${LONGCTX_ARGS:-} --json "$OUT/identity_longctx_${CARD}.json" 2>&1 \
    | tee "$OUT/longctx.log" | tail -14
}
# Tier mode (issue 11) as a 24 GB card: a resident run writes replay digests (no limit), then under
# XLA_PYTHON_CLIENT_MEM_FRACTION (TIER_MEM_FRACTION, 0.17) the tier identity gate (batched == replay,
# and replay == resident via --reference-json), the copy/compute overlap per layer and chunk pass, and
# prefill/decode speed at the budget's chunk with the expert cache's hit rate and the host-link bound.
# The tier identity run replays every prompt and decodes 3 x 15 tokens per prompt one row at a time,
# at about 11 tok/s (synthetic weights route uniformly: ~25% cache hits), so TIER_MAX_LEN 255 keeps
# it near 3 minutes: 14 prompts, 617 prompt + 630 decode one-row steps (~2 min) and 28 batched
# passes of ~1.3 s. At 22 GiB both chunks fit beside the cache (48 slots at --max-context 4096).
stage_tier() {
  local common=(--model qwen3.5-35b-a3b --chunks "${TIER_CHUNKS:-1024,4096}" --prompts benchmarks/prompts/identity_gpu.jsonl
                --max-len "${TIER_MAX_LEN:-255}" --new-tokens 16 --max-context 4096)
  python benchmarks/identity.py "${common[@]}" --json "$OUT/identity_resident_ref_${CARD}.json" 2>&1 | tail -2
  (
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${TIER_MEM_FRACTION:-0.17} XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${TIER_HOST_GB:-110}
    python benchmarks/identity.py "${common[@]}" --mode tier --device-budget-gb "${TIER_BUDGET_GB:-22}" \
      --reference-json "$OUT/identity_resident_ref_${CARD}.json" --json "$OUT/identity_tier_${CARD}.json" 2>&1 | tail -4
    stage_tier_overlap
    python benchmarks/speed.py --model qwen3.5-35b-a3b --mode tier --device-budget-gb "${TIER_BUDGET_GB:-22}" \
      --arms batch-ordered --lengths "${TIER_LENGTHS:-1024,8192,32768}" --chunk auto --decode-tokens 32 \
      --json "$OUT/speed_tier_${CARD}.json" 2>&1 | tail -6
  )
}
# Tier prefill's copy / compute overlap per layer and chunk pass (issue 11), alone (~3 min).
stage_tier_overlap() {
  XLA_PYTHON_CLIENT_MEM_FRACTION=${TIER_MEM_FRACTION:-0.17} XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${TIER_HOST_GB:-110} \
    python benchmarks/tier_overlap.py --model qwen3.5-35b-a3b --chunks "${TIER_OVERLAP_CHUNKS:-4096,8192}" \
    --device-budget-gb "${TIER_BUDGET_GB:-22}" --json "$OUT/tier_overlap_${CARD}.json" 2>&1 | tail -3
}
# Tier decode with BARO_TIER_DECODE=direct (issue 11): one graph per token, the misses read from
# pinned host memory by the MoE kernels (baro_moe_host). The tier identity gate against the
# resident reference (made first when the tier stage has not), then tier speed at TIER_DIRECT_LENGTHS.
# TIER_DIRECT_GATE=0: the speed only. BARO_MOE_HOST=direct: the GEMMs read the store themselves
# instead of the misses being staged in the call's scratch first.
stage_tier_direct() {
  local common=(--model qwen3.5-35b-a3b --chunks "${TIER_CHUNKS:-1024,4096}" --prompts benchmarks/prompts/identity_gpu.jsonl
                --max-len "${TIER_MAX_LEN:-255}" --new-tokens 16 --max-context 4096)
  local gate=${TIER_DIRECT_GATE:-1}  # 0: the speed only
  [ "$gate" = 0 ] || [ -f "$OUT/identity_resident_ref_${CARD}.json" ] || \
    python benchmarks/identity.py "${common[@]}" --json "$OUT/identity_resident_ref_${CARD}.json" 2>&1 | tail -2
  (
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${TIER_MEM_FRACTION:-0.17} XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${TIER_HOST_GB:-110}
    export BARO_TIER_DECODE=direct
    [ "$gate" = 0 ] || python benchmarks/identity.py "${common[@]}" --mode tier --device-budget-gb "${TIER_BUDGET_GB:-22}" \
      --reference-json "$OUT/identity_resident_ref_${CARD}.json" --json "$OUT/identity_tier_direct_${CARD}.json" 2>&1 | tail -4
    python benchmarks/speed.py --model qwen3.5-35b-a3b --mode tier --device-budget-gb "${TIER_BUDGET_GB:-22}" \
      --arms batch-ordered --lengths "${TIER_DIRECT_LENGTHS:-1024}" --chunk auto --decode-tokens 32 \
      --json "$OUT/speed_tier_direct_${CARD}.json" 2>&1 | tail -6
  )
}
# The host link by both ways tier decode can use (issue 11): copy engines vs the SMs' own loads
# of pinned memory, from cudaHostAlloc'd and from huge-page-advised registered memory
# (benchmarks/host_read_probe.cu, ~15 s): $OUT/host_read_probe_${CARD}.jsonl.
stage_host_probe() {
  nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/host_read_probe.cu -o /tmp/host_read_probe 2>&1 | tail -5
  timeout 120 /tmp/host_read_probe "${HOST_PROBE_MIB:-1024}" 5 | tee "$OUT/host_read_probe_${CARD}.jsonl"
}
# Where a tier decode token's time goes (issue 11), per decode path (TIER_PROFILE_PATHS: cache,
# cache+dma (BARO_TIER_FETCH=dma: the misses by the copy engines), direct): decode_profile.py --mode tier under the 24 GB-class limit at 1k context, with the
# expert cache's hit rate. The direct path's moe_stage_misses_kernel time over its misses' bytes
# is the rate the kernels read pinned memory at; the cache path's MemcpyH2D rows are the copy
# engines'. $OUT/decode_profile_tier_{cache,cache_dma,direct}_${CARD}.json.
stage_tier_profile() {  # one process (the synthetic weights made once), the paths one after the other
  XLA_PYTHON_CLIENT_MEM_FRACTION=${TIER_MEM_FRACTION:-0.17} XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${TIER_HOST_GB:-110} \
    timeout 300 python benchmarks/decode_profile.py --model qwen3.5-35b-a3b --mode tier \
    --device-budget-gb "${TIER_BUDGET_GB:-22}" --context 1024 --steps 8 --top 16 --tier-paths "${TIER_PROFILE_PATHS:-cache,cache+dma,direct}" \
    --json "$OUT/decode_profile_tier_{path}_${CARD}.json" 2>&1 | grep -v '^\[baro_jax\]' | tail -48
}
# Decode (issue 10): where a token's time goes at 1k and 32k context (benchmarks/decode_profile.py),
# then decode tok/s at 1k, 32k and 128k context (speed.py, batch-ordered prefill first) with its PNG.
# DECODE_PROFILE=0: the speeds only.
stage_decode() {
  [ "${DECODE_PROFILE:-1}" = 1 ] && for c in ${DECODE_CONTEXTS:-1024 32768}; do
    timeout 200 python benchmarks/decode_profile.py --model qwen3.5-35b-a3b --context "$c" --steps 32 --top 16 \
      --json "$OUT/decode_profile_${c}_${CARD}.json" 2>&1 | grep -v '^\[baro_jax\]' | tail -24
  done
  timeout 300 python benchmarks/speed.py --model qwen3.5-35b-a3b --arms batch-ordered \
    --lengths "${DECODE_LENGTHS:-1024,32768,131072}" --chunk auto --decode-tokens 64 --check-tail 32 \
    --json "$OUT/speed_decode_${CARD}.json" --decode-png "$OUT/decode_vs_context_${CARD}.png" 2>&1 | tail -8
}
# Decode knobs (issue 10), speed only, one speed.py per setting at KNOBS_LENGTH (1024) context,
# each identity-checked: the baseline, then each of KNOBS (default: BARO_MOE_TAIL=0, the
# one-token MoE's route and combine as their own kernels; BARO_MOE_TAIL=combine, the route
# kernel and the combine inside the down GEMM; BARO_PDL=1, the later kernels of a
# handler as programmatic dependent launches). BARO_DELTA_COLS=16 (twice the delta blocks)
# measured the same as the baseline (255.8 tok/s at 1k, f3ee9ae).
stage_decode_knobs() {
  local n=0
  for knob in "" ${KNOBS:-BARO_MOE_TAIL=0 BARO_MOE_TAIL=combine BARO_PDL=1}; do
    echo "--- knobs: ${knob:-none}"
    env $knob timeout 120 python benchmarks/speed.py --model qwen3.5-35b-a3b --arms batch-ordered \
      --lengths "${KNOBS_LENGTH:-1024}" --chunk auto --decode-tokens 64 --check-tail 32 \
      --json "$OUT/speed_decode_knobs${n}_${CARD}.json" 2>&1 | grep -E "decode|identity|Error|error" | tail -3
    n=$((n + 1))
  done
}
# The sm_90a prefill attention with each KV block's S issued one block early (BARO_ATTN_PIPE=1, the
# default: the tensor cores run it beside the previous block's softmax; the same bits), in parts
# (ATTN_PIPE_PARTS: tests ops speed): the attention byte tests (ATTN_PIPE_K: a pytest -k filter), the
# attention op alone (8192 rows) at ATTN_PIPE_CONTEXTS under each of ATTN_PIPE_LEVELS (0 1) on the same
# inputs ($OUT/op_times_attn_pipe<n>_ctx<c>_${CARD}.json; and with ATTN_PIPE_BASE_LIB's libraries at the
# default, $OUT/op_times_attn_pipe_base_ctx<c>_${CARD}.json),
# prefill at ATTN_PIPE_LENGTHS under each, identity-checked ($OUT/speed_attn_pipe<n>_${CARD}.json;
# on an H100 at chunk 2048 and 97%).
stage_attn_pipe() {
  local part c arm
  for part in ${ATTN_PIPE_PARTS:-tests ops speed}; do
    log "attn_pipe part $part"
    case $part in
      tests) timeout 240 python -m pytest -m gpu tests/test_kernels_attention.py -q -p no:cacheprovider ${ATTN_PIPE_K:+-k "$ATTN_PIPE_K"} 2>&1 \
               | tee "$OUT/gpu_attn_pipe_tests_${CARD}.txt" | tail -3 ;;
      ops) for c in ${ATTN_PIPE_CONTEXTS:-16384 32768}; do
             # each level, then (ATTN_PIPE_BASE_LIB: another build's libraries, e.g. an earlier csrc) that
             # build at the default beside them; NAME=VALUE for env, then the result's tag
             for arm in ${ATTN_PIPE_LEVELS:-0 1} ${ATTN_PIPE_BASE_LIB:+base}; do
               if [ "$arm" = base ]; then set -- "BARO_LIB_DIR=$ATTN_PIPE_BASE_LIB" _base; else set -- "BARO_ATTN_PIPE=$arm" "$arm"; fi
               env "$1" timeout 120 python benchmarks/op_times.py --m 8192 --context "$c" --ops attention \
                 --backends ordered --reps 10 --rounds 3 --json "$OUT/op_times_attn_pipe$2_ctx${c}_${CARD}.json" \
                 2>&1 | grep "op="
             done
           done ;;
      speed) (  # a subshell: the H100's chunk and memory fraction stay here
               [ "$CARD" = h100 ] && export XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 SPEED_UNDER_CHUNK=${SPEED_UNDER_CHUNK:-2048}
               speed_under BARO_ATTN_PIPE "${ATTN_PIPE_LEVELS:-0 1}" "${ATTN_PIPE_LENGTHS:-8192}" attn_pipe "${ATTN_PIPE_SPEED_TIMEOUT:-200}" ) ;;
      *) echo "attn_pipe: unknown part $part" ;;
    esac
  done
}
# The tiled GEMMs' grid order (BARO_PIPE_ORDER=cols: a row slot's column tiles side by side, so its
# A rows come from DRAM once and an expert's weight panels once for its tiles; ncu put the grouped
# prefill GEMMs at 77-82% of DRAM with 1.3-1.6x their floor's bytes, 2026-12-06), in parts
# (PIPE_ORDER_PARTS: tests ops): the tiled GEMM and MoE byte tests (the "-cols" tiles among
# them), then the MoE op at PIPE_ORDER_M rows under rows and cols on the same inputs
# ($OUT/op_times_moe_order<o>_${CARD}.json).
stage_pipe_order() {
  local part o
  for part in ${PIPE_ORDER_PARTS:-tests ops}; do
    log "pipe_order part $part"
    case $part in
      tests) timeout 240 python -m pytest -m gpu tests/test_kernels_matmul.py tests/test_kernels_moe.py -q \
               -p no:cacheprovider -k "tiles or folded" 2>&1 | tee "$OUT/gpu_pipe_order_tests_${CARD}.txt" | tail -3 ;;
      ops) for o in rows cols; do
             BARO_PIPE_ORDER=$o timeout 120 python benchmarks/op_times.py --m "${PIPE_ORDER_M:-8,4096,8192}" --ops moe \
               --backends ordered --reps 30 --rounds 3 --json "$OUT/op_times_moe_order${o}_${CARD}.json" 2>&1 | grep "op="
           done ;;
      *) echo "pipe_order: unknown part $part" ;;
    esac
  done
}
# The wgmma GEMMs at the H200's chunk (8,192 rows: there the MoE's math binds, not its bytes,
# docs/PERF.md 2026-12-06): byte tests, then under each of MOE_GROUPED_SETTINGS (space-separated;
# each a comma-joined list of assignments, e.g. BARO_GEMM_WGMMA_GROUPED=sorted,BARO_GEMM_WGMMA_BN=256)
# the MoE op ($OUT/op_times_moe_<n>_${CARD}.json) and an 8k prefill, identity-checked
# ($OUT/speed_moe_<n>_${CARD}.json), <n> the setting's index; the settings print beside the numbers.
stage_moe_grouped() {
  local part
  # by default the kernels before 3b96722 (mma.sync grouped GEMMs, 128-row W tiles) against today's auto
  local settings=${MOE_GROUPED_SETTINGS:-BARO_GEMM_WGMMA_GROUPED=0,BARO_GEMM_WGMMA_BN=128 BARO_GEMM_WGMMA_GROUPED=auto,BARO_GEMM_WGMMA_BN=auto}
  for part in ${MOE_GROUPED_PARTS:-tests ops speed}; do
    log "moe_grouped part $part"
    case $part in
      tests) timeout "${MOE_GROUPED_TEST_TIMEOUT:-200}" python -m pytest -m gpu tests/test_kernels_moe.py tests/test_kernels_matmul.py -q -p no:cacheprovider -k "wgmma" 2>&1 \
               | tee "$OUT/gpu_moe_grouped_tests_${CARD}.txt" | tail -3 ;;
      ops|speed) sweep_settings "$part" moe moe "${MOE_GROUPED_M:-4096,8192}" "${MOE_GROUPED_LENGTHS:-8192}" \
                   moe_grouped_settings "$settings" ;;
      *) echo "moe_grouped: unknown part $part" ;;
    esac
  done
}
# The GDN projection's conv channels packed as bf16 (BARO_GDN_PACK16, custom_calls/matmul.py): the
# byte tests (the packed GEMM on every kernel, the conv reading it; GDN_PACK_PARTS=tests), then a
# prefill at GDN_PACK_LENGTHS under off and auto (speed_gdn_pack{off,auto}), each identity-checked.
stage_gdn_pack() {
  local part
  for part in ${GDN_PACK_PARTS:-tests speed}; do
    log "gdn_pack part $part"
    case $part in
      tests) timeout "${GDN_PACK_TEST_TIMEOUT:-240}" python -m pytest -m gpu tests/test_kernels_matmul.py tests/test_kernels_conv.py \
               -q -p no:cacheprovider -k "pack" 2>&1 | tee "$OUT/gpu_gdn_pack_tests_${CARD}.txt" | tail -3 ;;
      speed) speed_under BARO_GDN_PACK16 "off auto" "${GDN_PACK_LENGTHS:-8192,32768}" gdn_pack 240 ;;
      *) echo "gdn_pack: unknown part $part" ;;
    esac
  done
}
# Where a prefill's host time goes (benchmarks/prefill_host.py): Engine.prefill's calls timed one by
# one on the host (checks, the fresh state, the first chunk's inputs and dispatch) beside the wall,
# at each of PREFILL_HOST_LENGTHS (1024 8192; SPEED_UNDER_CHUNK forces the chunk):
# $OUT/prefill_host_<len>_${CARD}.json.
stage_prefill_host() {
  local n
  for n in ${PREFILL_HOST_LENGTHS:-1024 8192}; do
    env ${GATE_ENV[@]+"${GATE_ENV[@]}"} timeout 150 python benchmarks/prefill_host.py --model qwen3.5-35b-a3b --length "$n" \
      ${SPEED_UNDER_CHUNK:+--chunk "$SPEED_UNDER_CHUNK"} --json "$OUT/prefill_host_${n}_${CARD}.json" 2>&1 \
      | grep -v '^\[baro_jax\]' | tail -11
  done
}
# The delta scan's same-bits knobs (BARO_DELTA_KV, BARO_DELTA_STAGE): their byte tests, then
# sweep_settings over DELTA_KNOB_SETTINGS: the delta op at DELTA_KNOB_M rows and, with
# DELTA_KNOB_SPEED=1, a prefill at DELTA_KNOB_LENGTHS (SPEED_UNDER_CHUNK as set):
# op_times_delta_<n>, speed_delta_<n>, numbered as delta_knob_settings.txt lists them.
# DELTA_KNOB_TESTS=0 skips the byte tests (a second call).
stage_delta_knobs() {
  local settings=${DELTA_KNOB_SETTINGS:-BARO_DELTA_STAGE=fixed BARO_DELTA_STAGE=index} parts=ops
  [ "${DELTA_KNOB_TESTS:-1}" = 1 ] && timeout "${DELTA_KNOB_TEST_TIMEOUT:-200}" python -m pytest -m gpu \
    tests/test_kernels_delta.py -q -p no:cacheprovider -k "same_bits_knobs or delta_blocks" 2>&1 \
    | tee "$OUT/gpu_delta_knob_tests_${CARD}.txt" | tail -3
  [ "${DELTA_KNOB_SPEED:-0}" = 1 ] && parts="ops speed"
  sweep_settings "$parts" delta delta "${DELTA_KNOB_M:-4096,8192}" "${DELTA_KNOB_LENGTHS:-8192}" delta_knob_settings \
    "$settings"
  return 0
}
# Where a prompt's prefill time goes (issue 31), kernel by kernel: decode_profile.py --prefill at
# each of PREFILL_PROFILE_LENGTHS (8192 32768) at the engine's chunk (PREFILL_PROFILE_CHUNK to force
# one), two traced prefills after one warm-up: $OUT/prefill_profile_<len>_${CARD}.json.
stage_prefill_profile() {
  local n
  for n in ${PREFILL_PROFILE_LENGTHS:-8192 32768}; do
    timeout 240 python benchmarks/decode_profile.py --model qwen3.5-35b-a3b --prefill --context "$n" --steps 2 \
      ${PREFILL_PROFILE_CHUNK:+--chunk "$PREFILL_PROFILE_CHUNK"} ${PREFILL_PROFILE_ARGS:-} --top 30 \
      --json "$OUT/prefill_profile_${n}_${CARD}.json" \
      2>&1 | grep -v '^\[baro_jax\]' | tail -34
  done
}
# Prefill at each of CHUNK_SWEEP_CHUNKS (8192,16384) in one process, every chunk identity-checked
# (speed.py's prefix and tail checks): whether a long prompt gains from chunks past DEFAULT_CHUNK.
stage_chunk_sweep() {
  timeout "${CHUNK_SWEEP_TIMEOUT:-400}" python benchmarks/speed.py --model qwen3.5-35b-a3b --arms batch-ordered \
    --lengths "${CHUNK_SWEEP_LENGTHS:-32768}" --chunk "${CHUNK_SWEEP_CHUNKS:-8192,16384}" --decode-tokens 16 \
    --check-tail 32 --json "$OUT/speed_chunk_sweep_${CARD}.json" 2>&1 | grep -E "tok/s|identity|Error|error" | tail -8
}
stage_speed() {
  python benchmarks/speed.py --model qwen3.5-35b-a3b --lengths "${SPEED_LENGTHS:-1024,8192}" --chunk 1024 \
    --json "$OUT/speed_qwen35_${CARD}.json" 2>&1 | tail -12
}
# Wheels the GPU machine lacks (fla-core, flash-linear-attention: pure Python) travel in .whl/
# (git-ignored); installed into /tmp/site (WHL_SITE), which is put in front of PYTHONPATH (torch/triton stay the machine's).
install_whl() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${WHL_SITE:-/tmp/site}" .whl/*.whl \
      && export PYTHONPATH=${WHL_SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}
  fi
  python -c "import fla, fla.ops.gated_delta_rule; print('fla', fla.__version__, fla.__file__)" 2>&1 | tail -1
}
# The transformers peer alone (about 70 GB of its own weights): $OUT/peer_hf_${CARD}.json, also copied to
# /tmp/peer_hf_${CARD}.json (stays while the machine is warm) for a later `PEER_JSON=/tmp/peer_hf_${CARD}.json ... vs_peer`.
stage_peer() {
  install_whl
  timeout "${VS_PEER_TIMEOUT:-300}" python benchmarks/peer_hf.py --model "${VS_MODEL:-qwen3.5-35b-a3b}" \
    --device "${VS_PEER_DEVICE:-cuda}" \
    --lengths "${VS_PEER_LENGTHS:-1024,8192,32768}" --repeats "${VS_PEER_REPEATS:-3}" \
    --json "$OUT/peer_hf_${CARD}.json" 2>&1 | tee "$OUT/peer_hf.log" | grep -v '^\[transformers\]'
  cp -f "$OUT/peer_hf_${CARD}.json" /tmp/peer_hf_${CARD}.json 2>/dev/null
}
# Ours vs the peer in one JSON + PNG. The peer runs first in a subprocess (its weights are freed
# before ours are made), unless PEER_JSON names a file stage_peer wrote. One device command may run
# 10 minutes: speed.py skips what would start after VS_DEADLINE_S and is killed at VS_TIMEOUT_S; it
# writes the JSON and PNG after every length, so a cut run still returns the lengths done.
# Env: VS_PEER_LENGTHS (1024,8192,32768: the peer's and ours), VS_LENGTHS (ours, a superset: e.g.
# 1024,8192,32768,131000 for ours at 128k beside the peer at the first three; 131,000 so that the
# prompt and its decode tokens fit a 131,072-position state), VS_PEER_CHUNKS (auto: the engine's own
# pick per length; e.g. auto,2048),
# VS_PEER_ARMS (batch-ordered,replay-ordered,batch-xla), VS_REPLAY_MAX (1024), VS_REPEATS (1),
# VS_PEER_REPEATS (3), VS_PEER_TIMEOUT (300), VS_DEADLINE_S (420), VS_TIMEOUT_S (560), PEER_JSON;
# VS_MODEL / VS_PEER_DEVICE only for a CPU check of the stage (tiny-random / cpu).
stage_vs_peer() {
  install_whl
  local peer=(--peer --peer-timeout "${VS_PEER_TIMEOUT:-300}" --peer-repeats "${VS_PEER_REPEATS:-3}"
              --peer-device "${VS_PEER_DEVICE:-cuda}")
  [ -n "${PEER_JSON:-}" ] && peer=()
  # On an 80 GB H100 the engine's own pick at 94% is chunk 256 for 8k and no room for 32k
  # (0f36f4b: 7.8k tok/s, 32k refused); 97% and chunk 4096 are what that card holds (GATE_ENV).
  local chunks=${VS_PEER_CHUNKS:-auto}
  [ "$CARD" = h100 ] && chunks=${VS_PEER_CHUNKS:-4096}
  env ${GATE_ENV[@]+"${GATE_ENV[@]}"} timeout "${VS_TIMEOUT_S:-560}" python benchmarks/speed.py --model "${VS_MODEL:-qwen3.5-35b-a3b}" \
    --lengths "${VS_LENGTHS:-${VS_PEER_LENGTHS:-1024,8192,32768}}" --peer-lengths "${VS_PEER_LENGTHS:-1024,8192,32768}" \
    --chunk "$chunks" \
    --arms "${VS_PEER_ARMS:-batch-ordered,replay-ordered,batch-xla}" --replay-max "${VS_REPLAY_MAX:-1024}" \
    --check-prefix 1088 --check-tail 64 --repeats "${VS_REPEATS:-1}" --deadline-s "${VS_DEADLINE_S:-420}" \
    ${peer[@]+"${peer[@]}"} --peer-json "${PEER_JSON:-$OUT/peer_hf_${CARD}.json}" \
    --json "$OUT/speed_vs_peer_${CARD}.json" --png "$OUT/speed_vs_peer_${CARD}.png" \
    --decode-png "$OUT/decode_vs_context_${CARD}.png" 2>&1 \
    | tee "$OUT/speed_vs_peer.log" | grep -v '^\[transformers\]'
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "speed.py killed at VS_TIMEOUT_S=${VS_TIMEOUT_S:-560}s; the JSON holds the lengths done"
  return "$rc"
}
# Many sequences (issue 29): aggregate decode tok/s of generate_batch at BATCH_SIZES (1k-token prompts,
# BATCH_NEW new tokens, the first sequences of each batch checked against their runs alone), then
# where one decode step's time goes at BATCH_PROFILE sizes (decode_profile.py --batch) and, unless
# BATCH_GATE=0, the many-sequence identity gate (benchmarks/batch_identity.py: BATCH_GATE_N
# sequences of 1 to BATCH_GATE_MAX_LEN tokens, staggered, half sampled, the last BATCH_GATE_SHARED (8)
# starting as one of the four before them does, against their runs alone).
# BATCH_PROFILE_ARGS reaches decode_profile.py (e.g. "--temperature 0.8 --top-p 0.95": a sampled step).
# BATCH_ROLLOUTS=P:K adds throughput.py's rollout row (P prompts x K samples, the prompt's prefill
# shared by its samples against prefilled per sample, the same bytes).
# BATCH_MIXED=N:LEN[:B] adds the mixed-load row (N prompts of LEN tokens arriving while B decode,
# e.g. 4:8192:32) for each of BATCH_MIXED_ROUNDS (on,off: a round's chunk and step in one pass or apart).
# BATCH_SAMPLING: throughput.py's sampling arguments for every sequence (e.g. "--temperature 1.0", an RL
# rollout's; "--temperature 0.7 --top-k 20 --top-p 0.8"), BATCH_TAG names its files (throughput_<tag>_<card>).
# A sampled row against the greedy one, throughput only:
#   OUT=dir BATCH_SIZES=8,64 BATCH_SAMPLING="--temperature 1.0" BATCH_TAG=temp1 BATCH_PROFILE= BATCH_GATE=0 bash benchmarks/run_gpu.sh batch
stage_batch() {
  # an H100 at 94% holds no slot of 1,280 positions beside the weights; at 97% B = 16 ran (0f36f4b)
  local sizes=${BATCH_SIZES:-1,8,32,64}
  [ "$CARD" = h100 ] && sizes=${BATCH_SIZES:-1,8,16}
  env ${GATE_ENV[@]+"${GATE_ENV[@]}"} timeout "${THROUGHPUT_TIMEOUT:-300}" python benchmarks/throughput.py --model qwen3.5-35b-a3b \
    --batches "$sizes" --prompt-len 1024 --new-tokens "${BATCH_NEW:-256}" --check 2 --bandwidth-tbs "$BANDWIDTH_TBS" \
    ${BATCH_MIXED:+--mixed "$BATCH_MIXED" --mixed-rounds "${BATCH_MIXED_ROUNDS:-on,off}"} ${BATCH_PREFILL_BUDGET:+--prefill-budget "$BATCH_PREFILL_BUDGET"} \
    ${BATCH_ROLLOUTS:+--rollouts "$BATCH_ROLLOUTS"} \
    ${BATCH_SAMPLING:-} --json "$OUT/throughput${BATCH_TAG:+_$BATCH_TAG}_${CARD}.json" --png "$OUT/throughput${BATCH_TAG:+_$BATCH_TAG}_${CARD}.png" 2>&1 \
    | grep -v '^\[baro_jax\]' | tail -8
  local b profile=${BATCH_PROFILE-1 8 64}
  [ "$CARD" = h100 ] && profile=${BATCH_PROFILE-1 8}
  for b in $profile; do  # BATCH_PROFILE= (empty): none
    env ${GATE_ENV[@]+"${GATE_ENV[@]}"} timeout 200 python benchmarks/decode_profile.py --model qwen3.5-35b-a3b --batch "$b" --context 1024 \
      --steps 32 --warmup 32 --top 24 ${BATCH_PROFILE_ARGS:-} \
      --json "$OUT/decode_profile_batch${b}${BATCH_TAG:+_$BATCH_TAG}_${CARD}.json" 2>&1 \
      | grep -v '^\[baro_jax\]' | tail -34
  done
  # an H100 holds 16 slots at chunk 256 and 24 at 1024 beside the weights (GATE_ENV)
  local configs=n/4:256,n:1024
  [ "$CARD" = h100 ] && configs=16:256,24:1024
  [ "${BATCH_GATE:-1}" = 0 ] || env ${GATE_ENV[@]+"${GATE_ENV[@]}"} timeout "${BATCH_GATE_TIMEOUT:-400}" python benchmarks/batch_identity.py \
    --model qwen3.5-35b-a3b --n "${BATCH_GATE_N:-64}" --max-len "${BATCH_GATE_MAX_LEN:-9000}" --new-tokens 32 \
    --max-context 9216 --configs "${BATCH_GATE_CONFIGS:-$configs}" --shared "${BATCH_GATE_SHARED:-8}" \
    --json "$OUT/batch_identity_${CARD}.json" 2>&1 | grep -v '^\[baro_jax\]' | tail -8
}
# baro_topk_rows on the GPU (csrc/gpu/topk_rows.cu; docs/PERF.md 2026-12-05): its byte tests
# against a numpy reference and lax.top_k, then sampled decode at BATCH_SIZES (Qwen3.5's
# generation_config sampling: temperature 0.7, top_k 20, top_p 0.8) with the draw's top_k from
# lax.top_k (BARO_TOPK_ROWS=off) and from the kernel (=all, the default);
# the ids are the same either way. $OUT/throughput_topk20_rows_{off,all}_${CARD}.json.
stage_topk() {
  timeout "${TOPK_TEST_TIMEOUT:-120}" python -m pytest -m gpu tests/test_kernels_topk.py -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_topk_tests_${CARD}.txt" | tail -3
  local w
  for w in off all; do
    echo "--- BARO_TOPK_ROWS=$w"
    BARO_TOPK_ROWS=$w timeout "${THROUGHPUT_TIMEOUT:-300}" python benchmarks/throughput.py --model qwen3.5-35b-a3b \
      --batches "${BATCH_SIZES:-8,64}" --prompt-len 1024 --new-tokens "${BATCH_NEW:-256}" --check 2 \
      --bandwidth-tbs "$BANDWIDTH_TBS" --temperature 0.7 --top-k 20 --top-p 0.8 \
      --json "$OUT/throughput_topk20_rows_${w}_${CARD}.json" 2>&1 | grep -v '^\[baro_jax\]' | tail -4
  done
}
# The many-sequence decode step's kernel knobs (speed only, same bits): decode_profile.py --batch
# BATCH_KNOBS_B (64) once per setting in BATCH_KNOBS, the step time and the kernels they move.
# The shared-A stream at B = 8 (docs/PERF.md 2026-12-05), after its byte tests
# (KERNELS_K=ashared ... kernels): BATCH_KNOBS_B=8 BATCH_KNOBS=BARO_ROW1_ASHARED=1 ... batch_knobs
# The persistent schedule of the grouped 16-row MoE GEMMs (BARO_ROWS16_PERSIST, docs/PERF.md 2026-12-05):
# its byte tests, then a B = 8 step with the knob off (the "" run) and on, then B = 64 (no loss there):
#   OUT=dir KERNELS_K=rows16_persist BATCH_KNOBS_B=8 BATCH_KNOBS=BARO_ROWS16_PERSIST=1 bash benchmarks/run_gpu.sh build kernels batch_knobs
#   OUT=dir BATCH_KNOBS_B=64 BATCH_KNOBS=BARO_ROWS16_PERSIST=1 bash benchmarks/run_gpu.sh batch_knobs
# and the per-call times and SM activity of gate/up and down, off then on (gemm_rows16_persist_kernel):
#   OUT=dir NCU_ROWS_OPS=moe bash benchmarks/run_gpu.sh ncu_rows; OUT=dir/on BARO_ROWS16_PERSIST=1 NCU_ROWS_OPS=moe bash benchmarks/run_gpu.sh ncu_rows
# A setting of several knobs joins them with commas: BATCH_KNOBS="BARO_ROW1_ASHARED=1,BARO_ROWS16_PERSIST=1".
stage_batch_knobs() {
  local n=0 knob
  for knob in "" ${BATCH_KNOBS:-BARO_DELTA_ONE=heads BARO_DELTA_ONE=off}; do
    echo "--- knobs: ${knob:-none}"
    env ${knob//,/ } timeout 120 python benchmarks/decode_profile.py --model qwen3.5-35b-a3b --batch "${BATCH_KNOBS_B:-64}" \
      --context 1024 --steps 32 --warmup 32 --top 6 --json "$OUT/decode_profile_batch${BATCH_KNOBS_B:-64}_knobs${n}_${CARD}.json" \
      2>&1 | grep -E "median step|traced:|  [0-9. ]+ ms " | head -8
    n=$((n + 1))
  done
}
# Tier mode runs the many-sequence pool (issue 29) as a 24 GB card: the many-sequence identity gate in
# resident mode (no limit) writes the reference, then under XLA_PYTHON_CLIENT_MEM_FRACTION
# (TIER_MEM_FRACTION, 0.17) and XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (TIER_HOST_GB, 110) the same gate in
# tier mode at TIER_BUDGET_GB (22): every batch sequence equals its tier run alone, and every tier run
# alone its resident one (--reference-json: ids, logprob and state bytes); then generate_batch
# throughput in tier mode at BATCH_TIER_SIZES (1,4,16; 1k-token prompts, BATCH_TIER_NEW new tokens,
# the first two of each batch checked alone) with the expert cache's counts per row. The cache has
# BATCH_TIER_CACHE_SLOTS (32) slots a layer: the default (~51 at 22 GiB, sized beside one prefill)
# leaves room for 2-4 pool slots of 2048 positions, 32 leaves 46. A decode step of many rows copies
# the misses of the union of their experts (B = 4: ~31 of 256 a layer), or stages the whole layer
# (1.5 GiB) when the union outgrows the cache (B = 16: ~100): ~1.3 s a step at the host link's
# ~50 GB/s, so B = 16 is the staging-bound row. $OUT/batch_identity_{resident_ref,tier}_${CARD}.json,
# $OUT/throughput_tier_${CARD}.json.
stage_batch_tier() {
  local common=(--model qwen3.5-35b-a3b --n "${BATCH_TIER_N:-16}" --max-len "${BATCH_TIER_MAX_LEN:-1100}" --new-tokens 16
                --max-context 2048 --configs "${BATCH_TIER_CONFIGS:-n/4:256,n:1024}" --replay 2 --replay-max-len 256)
  timeout "${BATCH_GATE_TIMEOUT:-400}" python benchmarks/batch_identity.py "${common[@]}" \
    --json "$OUT/batch_identity_resident_ref_${CARD}.json" 2>&1 | grep -v '^\[baro_jax\]' | tail -4
  (
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${TIER_MEM_FRACTION:-0.17} XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${TIER_HOST_GB:-110}
    local tier=(--mode tier --device-budget-gb "${TIER_BUDGET_GB:-22}" --cache-slots "${BATCH_TIER_CACHE_SLOTS:-32}")
    timeout "${BATCH_TIER_GATE_TIMEOUT:-560}" python benchmarks/batch_identity.py "${common[@]}" "${tier[@]}" \
      --reference-json "$OUT/batch_identity_resident_ref_${CARD}.json" \
      --json "$OUT/batch_identity_tier_${CARD}.json" 2>&1 | grep -v '^\[baro_jax\]' | tail -6
    timeout "${THROUGHPUT_TIMEOUT:-560}" python benchmarks/throughput.py --model qwen3.5-35b-a3b "${tier[@]}" --batches "${BATCH_TIER_SIZES:-1,4,16}" --prompt-len 1024 \
      --new-tokens "${BATCH_TIER_NEW:-32}" --chunk 1024 --check 2 --json "$OUT/throughput_tier_${CARD}.json" 2>&1 \
      | grep -v '^\[baro_jax\]' | tail -5
  )
}
# A fixed segmented K order's chains for the decode-shaped GEMMs, timed with today's kernel before
# any of it is built (benchmarks/k_segments_probe.py): S = 1 / 2 / 4 segments at KSEG_M rows,
# $OUT/k_segments_${CARD}.json. KSEG_ARGS: more of the script's arguments (e.g. "--segments 1
# --warm": each GEMM with its weight in L2 beside the cold one).
stage_k_segments() {
  timeout "${KSEG_TIMEOUT:-240}" python benchmarks/k_segments_probe.py --m "${KSEG_M:-1,8,16}" ${KSEG_ARGS:-} \
    --bandwidth-tbs "$BANDWIDTH_TBS" --json "$OUT/k_segments_${CARD}.json" 2>&1 | grep -E "gemm=|Error" | tail -40
}
# Teacher-forced agreement of the opt-in variants (bar 99%, benchmarks/agreement.py): $OUT/agreement_${CARD}.json,
# written after every prompt (the 8k prefill speeds first). Env: AGREE_CANDIDATES, AGREE_MAX_LEN (2049), AGREE_LIMIT
# (0: every prompt; 23 prompts take ~280 s on the H200), AGREE_CHUNK (1024), AGREE_TIMEOUT (560).
stage_agreement() {
  timeout "${AGREE_TIMEOUT:-560}" python benchmarks/agreement.py --model qwen3.5-35b-a3b \
    --candidate "${AGREE_CANDIDATES:-xla,attn-fast,delta-chunk}" --prompts benchmarks/prompts/identity_gpu.jsonl \
    --max-len "${AGREE_MAX_LEN:-2049}" --limit "${AGREE_LIMIT:-0}" --new-tokens 64 --chunk "${AGREE_CHUNK:-1024}" --max-context "${AGREE_MAX_CONTEXT:-8192}" \
    --speed-length "${AGREE_SPEED_LEN:-8192}" --json "$OUT/agreement_${CARD}.json" 2>&1 | tee "$OUT/agreement.log" | tail -16
}
# The OpenAI-compatible server under load (issue 30): SERVE_CLIENTS concurrent streaming clients per level
# (1k-token random prompts, SERVE_NEW new tokens, every other request sampled), throughput, TTFT and ITL
# p50/p99, every response's ids and logprob bytes checked against Engine.generate alone: $OUT/serve_${CARD}.json.
# SERVE_ARGS: more serve_bench.py arguments (e.g. "--sample-top-p 1.0": the sampled requests drawn in the
# pool's decode graphs), SERVE_TAG names the JSON (serve_<tag>_<card>.json).
# On an H100 the weights leave room for fewer slots: 97% of the card (GATE_ENV) and at most 16 clients
# (at 94% the pool found room for one slot beside a 256-row chunk, 8250fe3).
stage_serve() {  # needs the server's wheels in .whl (benchmarks/serve_wheels.sh, carried): the machine has none
  install_whl
  local clients=1,16,64; [ "$CARD" = h100 ] && clients=1,16
  env ${GATE_ENV[@]+"${GATE_ENV[@]}"} timeout "${SERVE_TIMEOUT:-560}" python benchmarks/serve_bench.py --model qwen3.5-35b-a3b \
    --clients "${SERVE_CLIENTS:-$clients}" ${SERVE_PREFILL_BUDGET:+--prefill-budget "$SERVE_PREFILL_BUDGET"} --prompt-len "${SERVE_PROMPT_LEN:-1024}" --new-tokens "${SERVE_NEW:-128}" \
    ${SERVE_ARGS:-} --json "$OUT/serve${SERVE_TAG:+_$SERVE_TAG}_${CARD}.json" 2>&1 | grep -v '^\[baro_jax\]' | tail -8
}
for s in "$@"; do log "$s"; "stage_$s" || log "stage $s FAILED"; done
log done
