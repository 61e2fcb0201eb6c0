#!/usr/bin/env bash
# One GPU session: build, kernel tests, identity gates, op times, speed.
# Usage: OUT=dir bash benchmarks/run_gpu.sh STAGE...   (stages: build kernels tiny ops probe full speed)
# Every stage logs to $OUT; a failing stage does not stop the later ones.
set -u
OUT=${OUT:-/tmp/baro_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export BARO_COMMIT=${BARO_COMMIT:-$(git rev-parse --verify HEAD 2>/dev/null)}
cd "$(dirname "$0")/.."
log() { echo "=== $(date +%T) $*" | tee -a "$OUT/stages.txt"; }
stage_build() {
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  if [ -n "${BARO_LIB_DIR:-}" ]; then echo "using prebuilt libraries in $BARO_LIB_DIR"; export PYTHONPATH=$PWD; else
  BARO_GPU=cuda pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; return 1; }; fi
  python -c "import custom_calls, jax; print(custom_calls.available_platforms(), jax.devices())"
}
stage_kernels() { python -m pytest -m gpu tests/test_kernels.py -q 2>&1 | tee "$OUT/gpu_kernel_tests.txt" | tail -25; }
stage_tiny() {
  python benchmarks/identity.py --model tiny --chunks 7,16,37,64 --max-len 1100 --json "$OUT/identity_tiny_gpu.json" 2>&1 | tail -6
}
stage_ops() { python benchmarks/op_times.py --m 1,256,1024 --json "$OUT/op_times_h200.json" 2>&1 | tail -30; }
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
stage_full() {
  python benchmarks/identity.py --model qwen3.5-35b-a3b --chunks 256,1024,2048 --prompts benchmarks/prompts/identity_gpu.jsonl \
    --max-context 8192 --json "$OUT/identity_qwen35_h200.json" 2>&1 | tail -40
}
stage_speed() {
  python benchmarks/speed.py --model qwen3.5-35b-a3b --lengths "${SPEED_LENGTHS:-1024,8192}" --chunk 1024 \
    --json "$OUT/speed_qwen35_h200.json" 2>&1 | tail -12
}
for s in "$@"; do log "$s"; "stage_$s" || log "stage $s FAILED"; done
log done
