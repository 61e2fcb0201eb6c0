"""Tokenizers: the checkpoint's tokenizer.json, or raw bytes for byte-level models."""
from __future__ import annotations

import json
import os


class ByteTokenizer:
    """One id per UTF-8 byte (ids 0..255)."""

    eos_id = None
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer.json plus the chat template from tokenizer_config.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.chat_template = None
        self.eos_id = None
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tc):
            with open(tc) as f:
                conf = json.load(f)
            self.chat_template = conf.get("chat_template")
            eos = conf.get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                self.eos_id = self._tok.token_to_id(eos)
        ct = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(ct):
            with open(ct) as f:
                self.chat_template = f.read()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def apply_chat_template(tok, user_text: str) -> str:
    if not getattr(tok, "chat_template", None):
        raise ValueError("--chat was given but this model has no chat template")
    try:
        import jinja2
    except ImportError as e:
        raise RuntimeError("--chat needs jinja2 (pip install jinja2)") from e
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
    tmpl = env.from_string(tok.chat_template)
    return tmpl.render(messages=[{"role": "user", "content": user_text}], add_generation_prompt=True)


def load_tokenizer(path: str | None):
    if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    return ByteTokenizer()
