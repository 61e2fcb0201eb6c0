"""Shared bits of the benchmark scripts: provenance for result JSON, prompt files."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess


def provenance() -> dict:
    import jax

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip())
    except OSError:
        commit, dirty = "unknown", False
    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "host": platform.node(),
        "commit": commit + ("+dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
    }


def load_prompts(path: str, tokenizer) -> list[dict]:
    """JSONL of {"text": ...} or {"ids": [...]}; returns [{"name", "ids"}]."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            o = json.loads(line)
            if "ids" in o:
                ids = [int(i) for i in o["ids"]]
            elif "text" in o:
                ids = tokenizer.encode(o["text"])
            else:
                raise ValueError(f"{path}:{n + 1}: a prompt needs 'text' or 'ids'")
            out.append({"name": o.get("name", f"p{n:02d}"), "ids": ids})
    return out


def write_json(path: str | None, obj: dict):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
