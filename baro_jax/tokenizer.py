"""Tokenizers: the checkpoint's tokenizer.json, or raw bytes for byte-level models."""
from __future__ import annotations

import json
import os
import sys


class ByteTokenizer:
    """One id per UTF-8 byte (ids 0..255)."""

    eos_id = None
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files cannot be read."""


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot be read ({e})") from None


def _chat_template(t, where: str):
    """tokenizer_config.json's chat_template: a string, or transformers' list of {name, template}
    (the one named 'default' is used)."""
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list) and all(isinstance(x, dict) and isinstance(x.get("template"), str) for x in t):
        named = {x.get("name"): x["template"] for x in t}
        if "default" in named:
            return named["default"]
        raise TokenizerError(f"{where}: field 'chat_template' lists templates {sorted(map(str, named))} "
                             "but none named 'default'")
    raise TokenizerError(f"{where}: field 'chat_template' must be a string, got {type(t).__name__}")


class HFTokenizer:
    """A `tokenizers` tokenizer.json plus the chat template from tokenizer_config.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        tj = os.path.join(path, "tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(tj)
        except Exception as e:  # the tokenizers library raises a bare Exception for any bad file
            raise TokenizerError(f"{tj}: not a tokenizer.json the tokenizers library can read ({e})") from None
        self.chat_template = None
        self.eos_id = None
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tc):
            conf = _read_json(tc)
            if not isinstance(conf, dict):
                raise TokenizerError(f"{tc}: a JSON object expected, got {type(conf).__name__}")
            self.chat_template = _chat_template(conf.get("chat_template"), tc)
            eos = conf.get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                self.eos_id = self._tok.token_to_id(eos)
            elif eos is not None:
                raise TokenizerError(f"{tc}: field 'eos_token' must be a string or an object with 'content', "
                                     f"got {type(eos).__name__}")
        ct = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(ct):
            try:
                with open(ct, encoding="utf-8") as f:
                    self.chat_template = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{ct}: cannot be read ({e})") from None

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


_warned_bytes: set = set()


def load_tokenizer(path: str | None):
    """The checkpoint's tokenizer.json; without one, byte-level ids (0..255) with a one-time
    warning on stderr (a checkpoint directory without tokenizer.json is usually incomplete)."""
    if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    if path and path not in _warned_bytes:
        _warned_bytes.add(path)
        print(f"[baro_jax] warning: {path} has no tokenizer.json; text is encoded as raw UTF-8 bytes "
              "(token ids 0..255), which is right only for a byte-level model", file=sys.stderr)
    return ByteTokenizer()
