"""Prompt files of the identity gate and the agreement harness: JSONL, one prompt a line."""
from __future__ import annotations

import json


def load_prompts(path: str, tokenizer) -> list[dict]:
    """Each non-empty line is {"text": ...} (through `tokenizer`) or {"ids": [...]}, with an
    optional "name" (default p00, p01, ... by line); returns [{"name", "ids"}] in file order."""
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


def select(prompts: list[dict], max_len: int = 0, limit: int = 0) -> list[dict]:
    """The prompts of at most max_len tokens (0: any), then the first `limit` of them (0: all)."""
    if max_len:
        prompts = [p for p in prompts if len(p["ids"]) <= max_len]
    return prompts[:limit] if limit else prompts
