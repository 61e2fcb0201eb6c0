"""Plot a speed.py JSON: prefill tokens/s vs prompt length (log x, log y), one line per arm;
with --decode-png also greedy decode tokens/s against the context it ran at.

    python benchmarks/plot_speed.py speed_vs_peer_h200.json [--png out.png] [--decode-png d.png]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

STYLE = {  # arm: (label, colour, marker, linestyle)
    "batch-ordered": ("baro_jax batch-ordered (identity-checked, see title)", "tab:blue", "o", "-"),
    "peer-hf": ("transformers peer", "tab:red", "s", "-"),
    "replay-ordered": ("baro_jax replay-ordered (decode step per token)", "tab:green", "^", "--"),
    "batch-xla": ("baro_jax batch-xla (plain jnp, not identical)", "tab:orange", "D", "--"),
}


def _token_ticks(ax, xs):
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])


def _save(fig, ax, path: str) -> str:
    import matplotlib.pyplot as plt

    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def series(obj: dict) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    rows = obj.get("rows", [])
    chunks = (obj.get("summary", {}).get("chunks") or [])
    for row in rows:
        n = row["prompt_tokens"]
        for arm in STYLE:
            r = row.get(arm) or {}
            if "tokens_per_s" in r:
                out.setdefault(arm, []).append((n, r["tokens_per_s"]))
        row_chunks = row.get("chunks") or chunks  # a row's own (speed.py --chunk auto resolves per length)
        if len(row_chunks) > 1:
            for c, r in (row.get("by_chunk") or {}).items():
                if str(c) != str(row_chunks[0]) and "tokens_per_s" in r:
                    out.setdefault(f"batch-ordered@{c}", []).append((n, r["tokens_per_s"]))
    return out


def plot(obj: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = obj.get("summary", {})
    data = series(obj)
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=120)
    chunks = s.get("chunks") or []
    for arm, pts in data.items():
        pts = sorted(pts)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if arm.startswith("batch-ordered@"):
            label, col, mk, ls = f"baro_jax batch-ordered, chunk {arm.split('@')[1]}", "tab:blue", ".", ":"
        else:
            label, col, mk, ls = STYLE[arm]
            if arm == "peer-hf":
                fla = (s.get("peer") or {}).get("fla_used")
                label = ("transformers peer, FLA delta rule" if fla else
                         "transformers peer, torch reference delta rule (FLA NOT used)" if fla is False else
                         "transformers peer")
            if arm == "batch-ordered" and chunks:
                label += ", chunk " + ("the engine's pick per length" if chunks[0] == "auto" else str(chunks[0]))
        ax.plot(xs, ys, ls, color=col, marker=mk, label=label)
        if arm in ("batch-ordered", "peer-hf"):
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:,.0f}", (x, y), textcoords="offset points", xytext=(4, 5), fontsize=7, color=col)
    for row in obj.get("rows", []):
        if "ratio_vs_peer" in row and "tokens_per_s" in (row.get("batch-ordered") or {}):
            ax.annotate(f"x{row['ratio_vs_peer']:.2f} of peer", (row["prompt_tokens"], row["batch-ordered"]["tokens_per_s"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=7, color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (one sequence)")
    ax.set_ylabel("prefill tokens / s")
    xs = sorted({r["prompt_tokens"] for r in obj.get("rows", [])})
    if xs:
        _token_ticks(ax, xs)
    peer = s.get("peer") or {}
    v = peer.get("versions") or {}
    sub = [f"{s.get('model', '?')} | {s.get('device', '?')} | commit {str(s.get('commit', '?'))[:10]} | "
           f"{s.get('date', '')} | jax {s.get('jax', '?')}"]
    if peer:
        sub.append(f"peer: transformers {v.get('transformers')}, torch {v.get('torch')}, fla {v.get('fla')}, "
                   f"triton {v.get('triton')}; FLA used: {peer.get('fla_used')}"
                   + (f"; error: {str(peer['error'])[:60]}" if peer.get("error") else ""))
    if s.get("checks_pass") is not None:
        sub.append(f"identity checks (batch-ordered): {'PASS' if s['checks_pass'] else 'FAIL'}")
    ax.set_title("Prefill speed\n" + "\n".join(sub), fontsize=8)
    return _save(fig, ax, path)


def plot_decode(obj: dict, path: str) -> str | None:
    """Decode tok/s (the batch-ordered rows' decode_tokens_per_s) against the context length."""
    pts = sorted((row["prompt_tokens"], (row.get("batch-ordered") or {})["decode_tokens_per_s"])
                 for row in obj.get("rows", []) if "decode_tokens_per_s" in (row.get("batch-ordered") or {}))
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = obj.get("summary", {})
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    ax.plot(xs, ys, "-", color="tab:blue", marker="o", label="baro_jax greedy decode (ordered, device blocks)")
    for x, y in pts:
        ax.annotate(f"{y:,.1f}", (x, y), textcoords="offset points", xytext=(4, 5), fontsize=7, color="tab:blue")
    ax.set_xscale("log", base=2)
    _token_ticks(ax, xs)
    ax.set_ylim(0, max(ys) * 1.2)
    ax.set_xlabel("context (prompt tokens before the decode steps)")
    ax.set_ylabel("decode tokens / s (batch 1)")
    ax.set_title(f"Decode speed\n{s.get('model', '?')} | {s.get('device', '?')} | commit "
                 f"{str(s.get('commit', '?'))[:10]} | {s.get('date', '')}", fontsize=8)
    return _save(fig, ax, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--png", default=None, help="default: the JSON's path with .png")
    ap.add_argument("--decode-png", default=None, help="also plot decode tok/s against context here")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        obj = json.load(f)
    print(plot(obj, args.png or os.path.splitext(args.json)[0] + ".png"))
    if args.decode_png:
        print(plot_decode(obj, args.decode_png) or "no decode_tokens_per_s in the rows: no decode plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
