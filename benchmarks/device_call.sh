#!/usr/bin/env bash
# One device-tool call: run_gpu.sh STAGE... under a wall limit (CALL_LIMIT_S, 570 s, inside the
# tool's 600 s), then everything it wrote goes back as one archive ($OUT/results.tgz) plus the stage
# log, since the tool returns at most 8 files. Usage on the device: bash benchmarks/device_call.sh build kernels
# Pass BARO_COMMIT as a literal sha: $(git rev-parse HEAD) in the command is evaluated on the
# device, whose git metadata can be older than the tree it was sent.
set -u
FINAL=${OUT:?set OUT to the return folder}
WORK=/tmp/baro_call; rm -rf "$WORK"; mkdir -p "$WORK"
OUT=$WORK timeout "${CALL_LIMIT_S:-570}" bash "$(dirname "$0")/run_gpu.sh" "$@"
rc=$?
[ "$rc" = 124 ] && echo "=== cut at CALL_LIMIT_S=${CALL_LIMIT_S:-570}s" | tee -a "$WORK/stages.txt"
tar czf "$FINAL/results.tgz" -C "$WORK" .
cp -f "$WORK/stages.txt" "$FINAL/" 2>/dev/null
exit "$rc"
