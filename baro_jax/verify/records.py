"""What a verification or benchmark JSON records besides its numbers: where and from what code
it ran, and the file itself, written so that a run cut short leaves valid JSON behind."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

from ..settings import recorded_commit, recorded_environment

# The package's own directory: in the editable install every script and test uses, it is inside
# the git work tree whose commit produced the numbers.
_HERE = os.path.dirname(os.path.abspath(__file__))


def git_commit(where: str = _HERE) -> str:
    """HEAD of the git tree holding `where`, with "+dirty" when tracked files differ from it;
    env BARO_COMMIT wins (a machine that got the tree without its history)."""
    commit = recorded_commit()
    if commit:
        return commit
    try:
        r = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True, cwd=where)
        if r.returncode != 0:
            return "unknown (no git history; set BARO_COMMIT)"
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, cwd=where).stdout.strip())
    except OSError:
        return "unknown (git not found; set BARO_COMMIT)"
    return r.stdout.strip() + ("+dirty" if dirty else "")


def provenance() -> dict:
    """Device, host, commit, UTC date, jax version and every environment knob that can change
    speed or the path taken (none may change bits)."""
    import jax

    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "host": platform.node(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "env": recorded_environment(),
    }


def echo(msg: str):
    """The harnesses' default log: a line on stdout, flushed, so that a run killed at a time
    limit keeps every line it printed."""
    print(msg, flush=True)


def write_json(path: str | None, obj: dict):
    """obj as indented JSON at path (its directory made); nothing when path is empty. The file
    is replaced in one rename, so a run killed mid-write keeps the previous complete file."""
    if not path:
        return
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
