"""Tokenizers: the checkpoint's tokenizer.json, or raw bytes for byte-level models."""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback


class ByteTokenizer:
    """One id per UTF-8 byte (ids 0..255)."""

    eos_id = None
    chat_template = None
    chat_template_file = None
    special_tokens: dict = {}

    def __init__(self, source: str | None = None):
        self.source = source  # the checkpoint directory without tokenizer files, if any

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
        self.source = path
        self.chat_template = None
        self.chat_template_file = None  # the file the template came from, for its error messages
        self.special_tokens = {}  # bos_token / eos_token text, which templates may print
        self.eos_id = None
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tc):
            conf = _read_json(tc)
            if not isinstance(conf, dict):
                raise TokenizerError(f"{tc}: a JSON object expected, got {type(conf).__name__}")
            self.chat_template = _chat_template(conf.get("chat_template"), tc)
            if self.chat_template is not None:
                self.chat_template_file = tc
            for key in ("bos_token", "eos_token"):
                tok = conf.get(key)
                text = tok.get("content") if isinstance(tok, dict) else tok
                if isinstance(text, str):
                    self.special_tokens[key] = text
                elif tok is not None:
                    raise TokenizerError(f"{tc}: field {key!r} must be a string or an object with a string "
                                         f"'content', got {type(tok).__name__} {tok!r:.80}")
            if "eos_token" in self.special_tokens:
                eos = self.special_tokens["eos_token"]
                self.eos_id = self._tok.token_to_id(eos)
                if self.eos_id is None:  # generation would never stop on it
                    raise TokenizerError(f"{tc}: field 'eos_token' {eos!r} is not a token of {tj}")
        ct = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(ct):  # as in transformers, the file wins over tokenizer_config.json's entry
            try:
                with open(ct, encoding="utf-8") as f:
                    self.chat_template = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{ct}: cannot be read ({e})") from None
            self.chat_template_file = ct

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _jinja_env(jinja2):
    """The environment transformers renders chat templates in: sandboxed (a template from the Hub
    is untrusted code), trim/lstrip blocks, loop controls, a tojson that does not HTML-escape, and
    the globals templates call (raise_exception, strftime_now)."""
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}...{% endgeneration %} marks the assistant's text for training masks;
        rendering keeps the text."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_keep"), [], [], body).set_lineno(lineno)

        def _keep(self, caller):
            return caller()

    def raise_exception(message):
        raise _TemplateRaised(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


class _TemplateRaised(Exception):
    """raise_exception(...) called by the template itself."""


def _template_line(tb, name: str):
    """The template line a render error happened on (jinja maps its frames to template lines)."""
    lines = [f.lineno for f in traceback.extract_tb(tb) if f.filename == name]
    return lines[-1] if lines else None


class NoChatTemplate(TokenizerError):
    """The checkpoint has no chat template; the message says why (no entry, no tokenizer files)."""


def apply_chat_template(tok, user_text: str) -> str:
    """The user text wrapped in the checkpoint's chat template (as transformers renders it, with a
    generation prompt). A missing template, a template Jinja cannot parse or render, or one that
    refuses the conversation is a ValueError naming the template file, the line and the reason."""
    try:
        return render_chat(tok, [{"role": "user", "content": user_text}])
    except NoChatTemplate as e:
        raise TokenizerError(f"--chat was given but {e}") from None


def render_chat(tok, messages: list) -> str:
    """A conversation (a list of {"role", "content"} dicts) in the checkpoint's chat template, with
    a generation prompt; errors as apply_chat_template's (NoChatTemplate when there is none)."""
    template = getattr(tok, "chat_template", None)
    if not template:
        src = getattr(tok, "source", None)
        where = (f"the checkpoint {src!r} has no chat template (neither tokenizer_config.json's 'chat_template' "
                 "nor chat_template.jinja)" if src and getattr(tok, "_tok", None) is not None else
                 f"the checkpoint {src!r} has no tokenizer files, so no chat template" if src else
                 "this model has no chat template (a preset has no tokenizer files)")
        raise NoChatTemplate(where)
    try:
        import jinja2
    except ImportError as e:
        raise RuntimeError("--chat needs jinja2 (pip install jinja2)") from e
    name = getattr(tok, "chat_template_file", None) or "the chat template"
    if name.endswith("tokenizer_config.json"):  # the lines are the template's, not the JSON file's
        name += " field 'chat_template'"
    env = _jinja_env(jinja2)
    # loaded under the file's name, so that jinja's frames (and so the error lines) carry it
    env.loader = jinja2.FunctionLoader(lambda _: (template, name, lambda: True))
    try:
        compiled = env.get_template(name)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{name}: chat template syntax error at line {e.lineno}: {e.message}") from None
    try:
        return compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=True, **getattr(tok, "special_tokens", {}))
    except _TemplateRaised as e:
        line = _template_line(e.__traceback__, name)
        raise TokenizerError(f"{name}: the chat template refused the conversation"
                             f"{f' (line {line})' if line else ''}: {e}") from None
    except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
            RecursionError) as e:
        line = _template_line(e.__traceback__, name)
        raise TokenizerError(f"{name}: the chat template fails to render{f' at line {line}' if line else ''}: "
                             f"{type(e).__name__}: {e}") from None


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
    return ByteTokenizer(path)
