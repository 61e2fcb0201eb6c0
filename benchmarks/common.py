"""Shared bits of the benchmark scripts: provenance for result JSON, prompt files."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess


def provenance() -> dict:
    import jax

    here = os.path.dirname(os.path.abspath(__file__))
    commit, dirty = os.environ.get("BARO_COMMIT", ""), False
    if not commit:
        try:
            r = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True, cwd=here)
            commit = r.stdout.strip() if r.returncode == 0 else "unknown (no git history; set BARO_COMMIT)"
            dirty = r.returncode == 0 and bool(subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                cwd=here).stdout.strip())
        except OSError:
            commit = "unknown (git not found; set BARO_COMMIT)"
    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "host": platform.node(),
        "commit": commit + ("+dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        # every knob that can change speed (none may change bits) or the path taken
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("BARO_", "XLA_PYTHON_CLIENT_", "XLA_PJRT_")) and k != "BARO_COMMIT"},
    }


def same_bytes(a, b) -> bool:
    """Two numpy arrays hold the same bytes (and the same dtype and shape)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def host_leaves(state) -> list:
    """Every leaf of a state pytree as a host numpy array, in tree order."""
    import jax
    import numpy as np

    return [np.asarray(a) for a in jax.tree_util.tree_leaves(state)]


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
