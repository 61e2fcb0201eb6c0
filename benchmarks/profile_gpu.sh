#!/usr/bin/env bash
# Kernel-level look on the GPU machine: ncu stall breakdown of the ordered
# kernels at prefill sizes, plus op-time A/B of speed-only knobs.
# Usage: OUT=dir bash benchmarks/profile_gpu.sh [m]   (after run_gpu.sh build; m = 1: decode kernels)
set -u
OUT=${OUT:-/tmp/baro_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
M=${1:-4096}
SECTIONS=(--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis)
prof() {  # prof <label> <kernel regex> <ops> <count>; NCU_ONLY (labels, comma list) runs a subset
  [ -n "${NCU_ONLY:-}" ] && [[ ",$NCU_ONLY," != *",$1,"* ]] && return 0
  timeout 120 ncu --clock-control none "${SECTIONS[@]}" -k "regex:$2" --launch-skip "${SKIP:-1}" --launch-count "$4" \
    python benchmarks/op_times.py --m "$M" --ops "$3" --reps 2 --backends ordered ${CTX:+--context "$CTX"} > "$OUT/ncu_$1.txt" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A" "$OUT/ncu_$1.txt" | head -40
}
if [ "$M" = 1 ]; then  # decode shapes: the kernels a decode token spends its time in (docs/PERF.md)
  # gemm_row1 on a K = 4096 GEMM (out_proj: 256 one-n-tile units, 1.5 TB/s in the decode
  # profile) and on in_proj (K = 2048, 3.1 TB/s): stall reasons of the short GEMMs
  echo "--- ncu gemm_row1 m=1 (gdn out_proj, K=4096)"; prof out_proj_m1 "gemm_row1" "matmul gdn_out_proj" 1
  echo "--- ncu gemm_row1 m=1 (gdn in_proj)"; prof in_proj_m1 "gemm_row1" "matmul gdn_in_proj" 1
  echo "--- ncu moe m=1 (route, grouped gate/up, grouped down, combine)"; prof moe_m1 "gemm_row1|moe_" moe 4
  # the attention decode at 32k (op_times puts the query at the middle of a 64k cache): the cache
  # write, the split kernel (1 block per split and kv head) and the in-order merge of 65 splits
  echo "--- ncu attention m=1 (32k context)"; CTX=65536 SKIP=3 prof attention_m1 "attn_" attention 3
  echo "--- ncu delta m=1"; prof delta_m1 "delta_kernel" delta 1
  echo "--- ncu conv m=1"; prof conv_m1 "conv" conv 1
  echo "--- ncu rmsnorm m=1"; prof rmsnorm_m1 "rmsnorm" rmsnorm 1
  exit 0
fi
echo "--- ncu delta"; prof delta "delta_kernel" delta 1
echo "--- ncu attention"; prof attention "attn_fa_kernel" attention 1
echo "--- ncu moe"; prof moe "gemm_pipe|moe_" moe 8
