#!/usr/bin/env bash
# compute-sanitizer over the GPU custom-call tests (issue 13): memcheck (out-of-bounds and
# misaligned device accesses, invalid frees, CUDA API errors) and racecheck (shared-memory
# hazards) while `pytest -m gpu tests/test_kernels_*.py` runs every ordered kernel.
#
# Usage, on the GPU machine from the repo root, after the CUDA library is built
# (BARO_GPU=cuda pip install --no-build-isolation --no-deps -e .):
#   OUT=dir bash benchmarks/sanitize_gpu.sh               # both tools
#   TOOLS=memcheck OUT=dir bash benchmarks/sanitize_gpu.sh # one tool per call when time is short
#   SANITIZE_K="attention or moe" ...                      # narrow the tests (pytest -k)
#   SANITIZE_SHARDS=files ...                               # one shard per tests/test_kernels_*.py
#     module, side by side: a sanitizer process that dies (memcheck's whole-suite pass at 0695bc5
#     was killed by SIGSEGV ~116 tests in, without a report) then takes one module's verdict with it
#   SANITIZE_SHARDS="moe_tiles;moe_row1" ...                # -k shards run side by side, one
#     sanitizer process each: racecheck's hazard analysis is slow per launch (a grouped MoE test
#     takes 80 s), and separate processes overlap it
#   SANITIZE_KERNELS=baro_gpu ...                           # instrument only kernels whose mangled
#     name holds this substring (--kernel-name kns=...): ours all live in namespace baro_gpu, so
#     XLA's own fusions and copies run uninstrumented (racecheck only reports shared-memory
#     hazards inside a kernel, and XLA's kernels are not ours to fix)
# Writes $OUT/sanitize_<tool>.txt (the full sanitizer + pytest output) and
# $OUT/sanitize_summary.json (errors / hazards per tool, pytest's result, provenance).
# Exit status: 0 only when every tool reports 0 errors (0 hazards) and pytest passed.
#
# Results: benchmarks/results/sanitize_*_h200.{json,txt} (CAPABILITIES' "GPU memory safety" row);
# benchmarks/sanitize_cover.py says which tests their clean shards cover, on the head's GPU sources.
set -u
OUT=${OUT:-/tmp/baro_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
TOOLS=${TOOLS:-"memcheck racecheck"}
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
PER_TOOL_TIMEOUT=${SANITIZE_TIMEOUT_S:-1800}
# One cudaMalloc per buffer instead of XLA's BFC pool: an access past a buffer's end then
# lands outside any allocation and memcheck sees it (inside a pool it would hit a neighbour).
export XLA_PYTHON_CLIENT_ALLOCATOR=platform
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# No CUDA graphs (the sanitizers follow plain launches best); no autotuning (faster, fewer XLA kernels).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"
# Left out: tests that only compare against baro_jax.ops_xla, i.e. run XLA's own kernels
# (cuBLAS, fusions); memcheck crashes inside those, and they exercise nothing of ours (every
# kernel is still covered by its own test against the float64 reference). Their names say so:
# "vs_ops_xla" (test_vs_ops_xla, test_attention_rows_vs_ops_xla) or "xla_reference".
DESELECT=${SANITIZE_DESELECT:-"vs_ops_xla xla_reference"}
KEXPR="not ${DESELECT// / and not }"
[ -n "${SANITIZE_K:-}" ] && KEXPR="($SANITIZE_K) and $KEXPR"

if ! command -v "$SAN" >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer /opt/nvidia/cuda/bin; do
    [ -x "$d/compute-sanitizer" ] && SAN="$d/compute-sanitizer" && break
  done
fi
command -v "$SAN" >/dev/null 2>&1 || [ -x "$SAN" ] || { echo "compute-sanitizer not found (set COMPUTE_SANITIZER=path)"; exit 2; }
python -c "import custom_calls, sys; p = custom_calls.available_platforms(); print('platforms', p); sys.exit(0 if 'CUDA' in p else 1)" \
  || { echo "libbaro_cuda.so not built: BARO_GPU=cuda pip install --no-build-isolation --no-deps -e ."; exit 2; }

rc_all=0
if [ "${SANITIZE_SHARDS:-}" = files ]; then
  # -k with the file name, .py included: test_kernels_attention.py does not match test_kernels_attention_rows.py
  SHARDS=(); for f in tests/test_kernels_*.py; do SHARDS+=("$(basename "$f")"); done
else
  IFS=';' read -r -a SHARDS <<< "${SANITIZE_SHARDS:-}"
fi
[ "${#SHARDS[@]}" -gt 0 ] || SHARDS=("")
run_one() {  # tool log kexpr extra...
  local tool=$1 log=$2 k=$3; shift 3
  [ -n "${SANITIZE_KERNELS:-}" ] && set -- "$@" --kernel-name "kns=$SANITIZE_KERNELS"
  echo "=== $tool: pytest -m gpu tests/test_kernels_*.py -k '$k'${SANITIZE_KERNELS:+ kernels matching '$SANITIZE_KERNELS'}" > "$log"
  local t0; t0=$(date +%s)
  timeout "$PER_TOOL_TIMEOUT" "$SAN" "$@" --target-processes all --print-limit 200 --error-exitcode 86 \
    python -m pytest -q -m gpu tests/test_kernels_*.py -k "$k" -p no:cacheprovider >> "$log" 2>&1
  local rc=$?
  echo "=== $tool: exit $rc in $(( $(date +%s) - t0 ))s" >> "$log"
  return $rc
}
for tool in $TOOLS; do
  case $tool in
    memcheck) extra=(--tool memcheck) ;;
    racecheck) extra=(--tool racecheck --racecheck-report all) ;;
    *) echo "unknown tool $tool"; exit 2 ;;
  esac
  pids=()
  for i in "${!SHARDS[@]}"; do
    k=$KEXPR; [ -n "${SHARDS[$i]}" ] && k="(${SHARDS[$i]}) and $KEXPR"
    suffix=""; [ "${#SHARDS[@]}" -gt 1 ] && suffix=".s$i"
    run_one "$tool" "$OUT/sanitize_$tool$suffix.txt" "$k" "${extra[@]}" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc_all=1; done
  for f in "$OUT"/sanitize_"$tool".txt "$OUT"/sanitize_"$tool".s*.txt; do
    [ -f "$f" ] && { head -1 "$f"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|error|=== $tool: exit" "$f" | tail -4; }
  done
done

python - "$OUT" $TOOLS <<'EOF'
import glob, json, os, re, subprocess, sys
out, tools = sys.argv[1], sys.argv[2:]
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:
        return f"unavailable: {e}"
res = {"script": "benchmarks/sanitize_gpu.sh", "git": os.environ.get("BARO_COMMIT") or sh("git rev-parse HEAD"),  # the device's git metadata can be stale
       "gpu": sh("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader"),
       "sanitizer": sh(f"{os.environ.get('COMPUTE_SANITIZER', 'compute-sanitizer')} --version | tail -1"),
       "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "BARO_"))}, "tools": {}}
ok = True
def parse(text, t):
    err = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    haz = re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text)
    py = re.findall(r"^=+ (.*(?:passed|failed|error).*) in [\d.]+s", text, re.M) or re.findall(r"^(\d+ passed.*)$", text, re.M)
    ex = re.findall(r"=== \w+: exit (\d+)", text)
    k = re.findall(r"-k '(.*?)'(?: kernels matching '(.*)')?$", text, re.M)
    # the tool's own failures (e.g. "failed to track a kernel launch"): counted in its error total,
    # and the launches after one may go unchecked, so they are reported apart from real findings
    internal = re.findall(r"Internal Sanitizer Error: (.*)", text)
    r = {"k": k[0][0] if k else None, "kernels": (k[0][1] or "all") if k else None, "errors": int(err[-1]) if err else None, "hazards": int(haz[-1]) if haz else None,
         "sanitizer_internal_errors": internal, "pytest": py[-1] if py else None, "exit": int(ex[-1]) if ex else None}
    r["clean"] = r["exit"] == 0 and not internal and (
        r["errors"] == 0 if t == "memcheck" else (r["hazards"] in (0, None) and r["errors"] in (0, None)))
    return r
for t in tools:
    logs = sorted(glob.glob(os.path.join(out, f"sanitize_{t}.s*.txt"))) or [os.path.join(out, f"sanitize_{t}.txt")]
    shards = [parse(open(f, errors="replace").read(), t) for f in logs]
    if len(shards) == 1:
        r = shards[0]
    else:  # one entry per shard, and the tool is clean only when every shard is
        r = {"shards": shards, "clean": all(x["clean"] for x in shards)}
        for key in ("errors", "hazards"):
            vals = [x[key] for x in shards]
            r[key] = None if None in vals else sum(vals)
    ok &= r["clean"]
    res["tools"][t] = r
res["clean"] = ok
json.dump(res, open(os.path.join(out, "sanitize_summary.json"), "w"), indent=1)
print(json.dumps(res, indent=1))
EOF
exit $rc_all
