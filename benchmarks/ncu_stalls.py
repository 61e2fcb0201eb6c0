"""Warp stall samples of one kernel, from ncu's source page (run_gpu.sh ncu_source writes it).

    python benchmarks/ncu_stalls.py benchmarks/results/ncu_source_delta_h100.csv.gz [--top 40]

Prints the samples by stall reason, by opcode, and the instructions with the most samples (with
their address, so a loop's lines can be read in order next to `cuobjdump -sass`).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import re
from collections import Counter


def read_rows(path: str) -> tuple[str, list[dict]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    lines = text.splitlines()
    # the page starts with a "Kernel Name" line, then the table's header and rows
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"Address"'))
    kernel = lines[0].split(",", 1)[1].strip('"') if lines[0].startswith('"Kernel Name"') else "?"
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    if not rows:
        raise SystemExit(f"{path}: no instructions in the source page")
    return kernel, rows


def num(x: str) -> int:
    try:
        return int(float(x.replace(",", "")))
    except (ValueError, AttributeError):
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=30, help="instructions to list, most samples first")
    args = ap.parse_args()
    kernel, rows = read_rows(args.csv)
    reasons = [k for k in rows[0] if k.startswith("stall_") and "(Not Issued)" not in k]
    total = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows)
    executed = sum(num(r["Instructions Executed"]) for r in rows)
    print(f"{kernel[:160]}\n{len(rows)} instructions, {total} samples, {executed} warp instructions executed")
    by_reason = Counter({k[6:]: sum(num(r[k]) for r in rows) for k in reasons})
    print("by reason: " + ", ".join(f"{k} {v} ({100 * v / max(total, 1):.1f}%)" for k, v in by_reason.most_common() if v))
    by_op = Counter()
    ex_op = Counter()
    for r in rows:
        op = r["Source"].strip().lstrip("@!P0123456789T ").split(" ")[0].split(".")[0]
        by_op[op] += num(r["Warp Stall Sampling (All Samples)"])
        ex_op[op] += num(r["Instructions Executed"])
    print("by opcode (samples / warp instructions executed):")
    for op, v in by_op.most_common(16):
        print(f"  {op:10s} {v:7d} {100 * v / max(total, 1):5.1f}%  {ex_op[op]:12d}")
    # loops: the spans of backward branches that hold at least 1% of the executed instructions
    base = int(rows[0]["Address"], 16)
    off = [int(r["Address"], 16) - base for r in rows]
    print("loops (backward branches; executed and sampled shares of the span):")
    for r, o in zip(rows, off):
        m = re.search(r"BRA (0x[0-9a-f]+)", r["Source"])
        if not m or int(m.group(1), 16) - base >= o:
            continue
        lo = int(m.group(1), 16) - base
        span = [x for x, ox in zip(rows, off) if lo <= ox <= o]
        ex = sum(num(x["Instructions Executed"]) for x in span)
        sm = sum(num(x["Warp Stall Sampling (All Samples)"]) for x in span)
        if ex >= 0.01 * executed:
            print(f"  {lo:#07x}..{o:#07x} {len(span):5d} instructions, branch taken {num(r['Instructions Executed']):10d}"
                  f" times: {100 * ex / max(executed, 1):5.1f}% executed, {100 * sm / max(total, 1):5.1f}% samples")
    print(f"top {args.top} instructions:")
    top = sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[: args.top]
    for r in top:
        s = num(r["Warp Stall Sampling (All Samples)"])
        why = sorted(((num(r[k]), k[6:]) for k in reasons), reverse=True)[:3]
        print(f"  {r['Address'][-5:]} {s:6d} {r['Source'].strip()[:48]:48s} " + " ".join(f"{k} {v}" for v, k in why if v))


if __name__ == "__main__":
    main()
