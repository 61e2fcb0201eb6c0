"""Which GPU kernel tests have a clean compute-sanitizer run, per tool (issue 13).

sanitize_gpu.sh runs in -k shards, often over several device calls (racecheck is slow per
launch), so no single summary covers the suite. This reads the summaries
(benchmarks/results/sanitize_*_h200.json), keeps the shards that ended clean (exit 0, a
summary, 0 errors / hazards, no sanitizer-internal error), collects each shard's -k with
pytest here, and reports every test of `pytest -m gpu tests/test_kernels_*.py` (less the
deselected XLA-only test) that no clean shard covers. A shard counts only when its run's
commit has the GPU sources of the commit checked here (csrc/ and custom_calls/ unchanged), so
a clean run of an older kernel is not taken for the head's.

    python benchmarks/sanitize_cover.py benchmarks/results/sanitize_*_h200.json \
        --json benchmarks/results/sanitize_cover_h200.json

Exit status 0 only when every tool asked for (--tools, default memcheck racecheck) covers
every test.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the kernel tests, one file per op (sanitize_gpu.sh runs the same glob); ids name their file, so
# a shard collected here is compared with the head's files, whatever file its run named
TESTS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "test_kernels_*.py")))
ALL_K = "not test_vs_ops_xla"  # sanitize_gpu.sh's default deselection
GPU_SOURCES = ("csrc", "custom_calls")


@lru_cache(maxsize=None)
def collect(k: str) -> frozenset[str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *TESTS, "--collect-only", "-q", "-p", "no:cacheprovider", "-k", k]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    ids = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln]
    if r.returncode not in (0, 5):  # 5: nothing collected
        raise SystemExit(f"sanitize_cover: pytest could not collect -k {k!r}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return frozenset(ids)


@lru_cache(maxsize=None)
def same_gpu_sources(commit: str, against: str) -> bool:
    r = subprocess.run(["git", "diff", "--quiet", commit, against, "--", *GPU_SOURCES], cwd=ROOT)
    return r.returncode == 0


def shards_of(summary: dict, path: str):
    """(commit, tool, shard) for every shard of a summary. sanitize_gpu.sh writes tools -> tool
    -> (shards | one shard); a hand-merged file holds several runs under runs -> name, each
    either such a summary or, in older files, the shards of the one tool its name says
    (sanitize_<tool>_...)."""
    runs = {"": summary} if "tools" in summary else summary.get("runs", {})
    file_tool = os.path.basename(path).split("_")[1] if os.path.basename(path).count("_") > 1 else None
    for run in runs.values():
        commit = run.get("git") or summary.get("git")
        tools = run.get("tools") or ({file_tool: run} if file_tool else {})
        for tool, r in tools.items():
            for s in r.get("shards", [r]):
                yield commit, tool, s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summaries", nargs="+", help="sanitize_gpu.sh summary JSON files")
    ap.add_argument("--tools", default="memcheck,racecheck")
    ap.add_argument("--against", default="HEAD", help="the commit whose GPU sources the runs must have")
    ap.add_argument("--json", help="write the coverage here")
    a = ap.parse_args(argv)
    tools = a.tools.split(",")
    everything = collect(ALL_K)
    if not everything:
        raise SystemExit("sanitize_cover: no GPU kernel tests collected")
    covered = {t: {} for t in tools}
    skipped = []
    for path in a.summaries:
        summary = json.load(open(path))
        for commit, tool, s in shards_of(summary, path):
            if tool not in covered or not s.get("k"):
                continue
            why = None
            if not s.get("clean"):
                why = "not clean"
            elif s.get("sanitizer_internal_errors"):
                why = "sanitizer-internal error"
            elif not commit or not same_gpu_sources(commit, a.against):
                why = f"GPU sources at {commit} differ from {a.against}"
            if why:
                skipped.append({"file": os.path.basename(path), "tool": tool, "k": s["k"], "why": why})
                continue
            for test in collect(s["k"]):
                covered[tool].setdefault(test, []).append(os.path.basename(path))
    out = {"against": subprocess.run(["git", "rev-parse", a.against], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
           "tests": len(everything), "tools": {}, "skipped_shards": skipped}
    ok = True
    for t in tools:
        missing = sorted(everything - set(covered[t]))
        out["tools"][t] = {"covered": len(everything) - len(missing), "missing": missing,
                           "files": sorted({f for fs in covered[t].values() for f in fs})}
        ok &= not missing
        print(f"{t}: {len(everything) - len(missing)}/{len(everything)} GPU kernel tests have a clean run"
              + (f"; missing {len(missing)}: " + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "") if missing else ""))
    for s in skipped:
        print(f"  not counted ({s['why']}): {s['tool']} -k {s['k']!r} in {s['file']}")
    out["complete"] = ok
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
