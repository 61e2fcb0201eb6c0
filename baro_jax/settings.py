"""Every runtime setting in one frozen object, read from arguments and the environment once.

`Settings.resolve(**arguments)` takes what a caller gave (`load(...)`'s keywords, the CLI's
flags), fills the rest from the `BARO_*` environment variables and the defaults below, checks
every value, and returns one frozen `Settings`. Nothing else in `baro_jax` reads a `BARO_*`
variable: the engine, its runners and the CLI take their settings from this object.

Parsing is strict. An on/off value is one of 1/0, true/false, on/off, yes/no (any case);
anything else is an error naming the variable. Numbers are range-checked. An empty variable
counts as unset.

The kernel library's own knobs (read by the C++ code on each call, speed or test switches that
never change the bits, but for BARO_DELTA_BLOCKED_MMA, which picks the blocked delta rule's
arithmetic) are listed in `custom_calls.knobs`; `settings_table()` prints both
tables, and the README's table is checked against it (tests/test_settings.py).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, Callable, Mapping

ON = ("1", "true", "on", "yes")


def np_bool():
    import numpy as np

    return np.bool_
OFF = ("0", "false", "off", "no")

PREFILL_MODES = ("batch", "replay")
ENGINE_MODES = ("resident", "tier")
VARIANTS = ("xla", "attn-fast", "delta-chunk")
DELTA_RULES = ("token", "blocked")
BACKENDS = ("ordered", "xla")
DTYPES = ("bfloat16", "float32")
TIER_DECODE_PATHS = ("auto", "cache", "direct")
TIER_FETCH_PATHS = ("xla", "dma")
ATTN_IMPLS = ("auto", "xla", "cudnn")

DEFAULT_CHUNK = 8192  # the largest chunk a request uses unless told otherwise (H200: 8192 beat 4096 and 2048, benchmarks/results/speed_chunks_h200.json)
DEFAULT_DECODE_BLOCK = 16  # greedy decode steps per device call
MAX_DECODE_BLOCK = 4096
DEFAULT_CACHE_SLOTS = 64  # tier decode expert cache slots per layer (fewer when the budget says so)
# KV positions per page of the many-sequence pool (pool.py): a multiple of the attention kernels'
# 64-position KV block; smaller pages waste less on short sequences, larger ones mean fewer table entries
DEFAULT_KV_PAGE = 64


class SettingsError(ValueError):
    """A setting (argument, flag or environment variable) has a value it cannot take."""


class SettingsTypeError(SettingsError, TypeError):
    """A setting given as the wrong type (a float where an integer belongs, ...): both a
    SettingsError and a TypeError, so callers may catch either."""


# --- parsers: (value, name) -> parsed value; name is what the message calls it ----------------------
def parse_bool(v, name: str) -> bool:
    if isinstance(v, (bool, np_bool())):
        return v
    if isinstance(v, str):
        s = v.strip().lower()
        if s in ON:
            return True
        if s in OFF:
            return False
    raise SettingsError(f"{name} must be on or off (one of {'/'.join(ON)} or {'/'.join(OFF)}), got {v!r}")


def parse_int(lo: int | None = None, hi: int | None = None) -> Callable[[Any, str], int]:
    def parse(v, name: str) -> int:
        if isinstance(v, bool) or isinstance(v, float):
            raise SettingsTypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
        if isinstance(v, str):
            s = v.strip()
            try:
                v = int(s, 10)
            except ValueError:
                raise SettingsError(f"{name} must be an integer, got {s!r}") from None
        if not isinstance(v, numbers.Integral):
            raise SettingsTypeError(f"{name} must be an integer, got {type(v).__name__} {v!r:.60}")
        v = int(v)
        if lo is not None and v < lo:
            raise SettingsError(f"{name} must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise SettingsError(f"{name} must be <= {hi}, got {v}")
        return v

    parse.text_from_env_only = True
    parse.expects = "an integer"
    return parse


def parse_positive_float(v, name: str) -> float:
    if isinstance(v, bool):
        raise SettingsTypeError(f"{name} must be a number, got {v!r}")
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise SettingsError(f"{name} must be a number, got {v!r}") from None
    if not isinstance(v, numbers.Real):
        raise SettingsTypeError(f"{name} must be a number, got {type(v).__name__} {v!r:.60}")
    f = float(v)
    if not math.isfinite(f) or f <= 0:
        raise SettingsError(f"{name} must be a finite number > 0, got {v!r}")
    return f


parse_bool.text_from_env_only = True
parse_positive_float.text_from_env_only = True


def parse_choice(choices: tuple, aliases: Mapping[str, Any] | None = None) -> Callable[[Any, str], Any]:
    aliases = dict(aliases or {})

    def parse(v, name: str):
        if isinstance(v, str):
            s = v.strip()
            if s in aliases:
                return aliases[s]
            if s in choices:
                return s
        elif v in aliases.values() and v is not None:
            return v
        shown = [c for c in choices] + [a for a in aliases if a not in choices]
        raise SettingsError(f"{name} must be one of {', '.join(shown)}, got {v!r}")

    return parse


def parse_mode_env(v, name: str) -> str:
    """BARO_TIER: on -> tier, off -> resident."""
    return "tier" if parse_bool(v, name) else "resident"


def parse_prefill_env(v, name: str) -> str:
    """BARO_PREFILL: 1 (on) -> batch, 0 (off) -> replay."""
    return "batch" if parse_bool(v, name) else "replay"


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one field is set: its argument / CLI flag, its environment variable (None: none), the
    parser for each, and the line the settings table shows."""
    field: str
    flag: str | None
    env: str | None
    parse: Callable[[Any, str], Any]
    doc: str
    env_parse: Callable[[Any, str], Any] | None = None
    default_text: str | None = None


def _variant(v, name):
    if v is None:
        return None
    v = parse_choice(VARIANTS + ("none",))(v, name)
    return None if v == "none" else v


SPECS: tuple[Spec, ...] = (
    Spec("backend", "--backend", None, parse_choice(BACKENDS + ("auto",)),
         "ordered: the row-invariant custom calls (the product); xla: plain jnp, the numeric reference; "
         "auto: ordered where its library is built and the dtype is bfloat16", default_text="auto"),
    Spec("dtype", "--dtype", None, parse_choice(DTYPES), "weights and KV cache dtype (ordered runs bfloat16 only)"),
    Spec("mode", "--mode", "BARO_TIER", parse_choice(ENGINE_MODES),
         "resident: every weight in device memory; tier: routed experts in pinned host memory, staged per layer "
         "(BARO_TIER=on means tier)", env_parse=parse_mode_env),
    Spec("prefill", "--prefill", "BARO_PREFILL", parse_choice(PREFILL_MODES),
         "batch: chunked prefill; replay: the decode step once per prompt token (the identity reference; "
         "BARO_PREFILL=on means batch)", env_parse=parse_prefill_env),
    Spec("chunk", "--chunk", "BARO_PREFILL_C", parse_int(lo=1),
         f"prefill rows per call; auto: the prompt's next power of two up to {DEFAULT_CHUNK}, halved until the "
         "request fits the device budget (tier mode: the largest that fits, up to the whole prompt); never "
         "changes the bits", default_text="auto"),
    Spec("variant", "--variant", "BARO_VARIANT", _variant,
         "an opt-in order-changing variant on the ordered backend (xla, attn-fast, delta-chunk), judged by "
         "teacher-forced agreement, not identity; none: the ordered ops as they are", default_text="none"),
    Spec("delta_rule", "--delta-rule", "BARO_DELTA", parse_choice(DELTA_RULES),
         "token: the per-token delta rule; blocked: the chunk-aligned rule (docs/DESIGN.md §9, its own bits, "
         "identity within it)"),
    Spec("max_context", "--max-context", None, parse_int(lo=1),
         "context length in tokens (at most the model's)", default_text="the model's"),
    Spec("device_budget_gb", "--device-budget-gb", None, parse_positive_float,
         "device memory to plan for, in GiB; requests that cannot fit are refused before any work",
         default_text="95% of the device"),
    Spec("devices", "--devices", None, parse_int(lo=1),
         "expert parallel over N devices (routed experts sharded along E; one device's bytes)",
         default_text="none (one device, no mesh)"),
    Spec("cache_slots", "--cache-slots", "BARO_CACHE_SLOTS", parse_int(lo=0),
         f"tier mode: decode expert cache slots per layer (0: none); auto: {DEFAULT_CACHE_SLOTS}, fewer when "
         "the budget says so", default_text="auto"),
    Spec("allow_nonfinite", "--allow-nonfinite", "BARO_ALLOW_NONFINITE", parse_bool,
         "load a checkpoint even when some weights hold NaN or Inf"),
    Spec("decode_block", None, "BARO_DECODE_BLOCK", parse_int(lo=1, hi=MAX_DECODE_BLOCK),
         "greedy decode steps per device call (1: one call per token); never changes the bits"),
    Spec("mixed_rounds", None, "BARO_MIXED_ROUNDS", parse_bool,
         "many sequences: a round's first prefill chunk and its decode step in one pass, each weight read once "
         "for both (in tier mode each layer staged once for both); never changes the bits"),
    Spec("tier_decode", None, "BARO_TIER_DECODE", parse_choice(TIER_DECODE_PATHS),
         "tier decode: cache (routing to the host, LRU copies, then the MoE), direct (one graph per block, "
         "misses read from the host store by the MoE kernel), auto (direct where the kernels can, else cache)"),
    Spec("tier_fetch", None, "BARO_TIER_FETCH", parse_choice(TIER_FETCH_PATHS),
         "tier decode cache path: how misses are copied into the pools (xla: a jitted slice of the store; "
         "dma: copy-engine copies from host addresses)"),
    Spec("tier_adapt", None, "BARO_TIER_ADAPT", parse_bool,
         "direct tier decode: move the pools toward the experts routed most, between calls"),
    Spec("ep_pairs", None, "BARO_EP_PAIRS", parse_bool,
         "expert parallel: run the per-pair kernels and the all-gather even on one device (to time or test them)",
         default_text="auto (on above one device)"),
    Spec("attn_impl", None, "BARO_ATTN_IMPL", parse_choice(ATTN_IMPLS),
         "the attn-fast variant's prefill attention: cudnn on a CUDA GPU, xla elsewhere (auto)"),
    Spec("traceback", None, "BARO_TRACEBACK", parse_bool,
         "the CLI prints the Python traceback of an internal error instead of one line"),
)
SPEC_BY_FIELD = {s.field: s for s in SPECS}
# Read by the benchmarks' records, not the engine: the commit a result JSON names, for a machine
# that got the tree without its git history.
RECORD_VARS = {"BARO_COMMIT": "the commit a result JSON records (default: git's HEAD of the tree)"}
ENV_VARS = tuple(s.env for s in SPECS if s.env) + tuple(RECORD_VARS)
RECORDED_PREFIXES = ("BARO_", "XLA_PYTHON_CLIENT_", "XLA_PJRT_")


def recorded_commit() -> str:
    """BARO_COMMIT, or "" when unset."""
    return os.environ.get("BARO_COMMIT", "").strip()


def allocator_mem_fraction() -> str | None:
    """XLA_PYTHON_CLIENT_MEM_FRACTION as given (the share of a GPU JAX's allocator takes), or None
    when unset (JAX's default, 0.75); budget.py names it when it refuses a request."""
    return os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or None


def recorded_environment() -> dict:
    """The variables that may change speed or the path taken (never the bits), as a result JSON
    records them: BARO_* settings and knobs and the XLA allocator's, BARO_COMMIT aside."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_PREFIXES) and k not in RECORD_VARS}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The engine's runtime settings (module docstring). Build one with Settings.resolve()."""
    backend: str = "auto"
    dtype: str = "bfloat16"
    mode: str = "resident"
    prefill: str = "batch"
    chunk: int | None = None
    variant: str | None = None
    delta_rule: str = "token"
    max_context: int | None = None
    device_budget_gb: float | None = None
    devices: int | None = None
    cache_slots: int | None = None
    allow_nonfinite: bool = False
    decode_block: int = DEFAULT_DECODE_BLOCK
    mixed_rounds: bool = True
    tier_decode: str = "auto"
    tier_fetch: str = "xla"
    tier_adapt: bool = True
    ep_pairs: bool | None = None
    attn_impl: str = "auto"
    traceback: bool = False

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **given) -> "Settings":
        """Settings from `given` (None: not given), else the environment, else the defaults; every
        value checked once, errors naming the argument (and flag) or the variable."""
        env = os.environ if env is None else env
        unknown = set(given) - set(SPEC_BY_FIELD)
        if unknown:
            raise TypeError(f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(SPEC_BY_FIELD)}")
        values = {}
        for spec in SPECS:
            v = given.get(spec.field)
            if v is not None:
                values[spec.field] = _parse_given(spec, v)
                continue
            raw = env.get(spec.env, "") if spec.env else ""
            if raw.strip():
                values[spec.field] = (spec.env_parse or spec.parse)(raw, spec.env)
        s = cls(**values)
        s.check()
        return s

    def replace(self, **changes) -> "Settings":
        """A copy with `changes` (parsed and checked as resolve() does, the environment not read)."""
        for k, v in list(changes.items()):
            spec = SPEC_BY_FIELD.get(k)
            if spec is None:
                raise TypeError(f"unknown setting {k!r}")
            if v is not None:
                changes[k] = _parse_given(spec, v)
        s = dataclasses.replace(self, **changes)
        s.check()
        return s

    def check(self):
        """The rules between settings."""
        if self.variant is not None and self.backend not in ("auto", "ordered"):
            raise SettingsError(f"variant {self.variant!r} is built on the ordered backend; drop backend="
                                f"{self.backend!r} (the plain-jnp backend is also the 'xla' variant)")
        if self.backend == "ordered" and self.dtype != "bfloat16":
            raise SettingsError("the 'ordered' backend runs bfloat16 only; use --dtype bfloat16 or --backend xla")
        if self.variant is not None and self.dtype != "bfloat16":
            raise SettingsError(f"variant {self.variant!r} runs on the ordered backend, bfloat16 only")
        if self.variant == "delta-chunk" and self.delta_rule == "blocked":
            raise SettingsError("variant delta-chunk replaces the per-token delta rule; it cannot run with "
                                "delta_rule blocked (--delta-rule blocked, BARO_DELTA=blocked): choose one")
        if self.cache_slots and self.mode != "tier":
            raise SettingsError("cache_slots (--cache-slots) sizes tier mode's decode expert cache; "
                                "give mode='tier' (--mode tier) or leave it out")
        if self.devices is not None:
            if self.mode != "resident":
                raise SettingsError(f"devices (--devices) {self.devices}: expert parallel runs in resident mode, "
                                    f"not {self.mode!r}")
            if self.backend == "xla" or self.variant:
                raise SettingsError(f"devices (--devices) {self.devices}: expert parallel runs the ordered kernels; "
                                    f"got backend {self.backend!r}"
                                    + (f" with variant {self.variant!r}" if self.variant else ""))

    def describe(self) -> dict:
        return dataclasses.asdict(self)


def _parse_given(spec: Spec, v):
    """An argument's value: numbers and on/off settings take Python values (text is what the
    environment gives, not an argument), choices take their names."""
    name = spec.field + (f" ({spec.flag})" if spec.flag else "")
    if isinstance(v, str) and getattr(spec.parse, "text_from_env_only", False):
        what = "True or False" if spec.parse is parse_bool else getattr(spec.parse, "expects", "a number")
        raise SettingsTypeError(f"{name} must be {what}, got str {v!r}")
    return spec.parse(v, name)


def _default_text(spec: Spec) -> str:
    if spec.default_text is not None:
        return spec.default_text
    v = getattr(Settings(), spec.field)
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def settings_table() -> str:
    """The Markdown tables of every setting (runtime, then the kernel library's knobs), as the
    README shows them."""
    rows = ["| setting | flag / argument | environment | default | what it does |", "|---|---|---|---|---|"]
    for s in SPECS:
        flag = f"`{s.flag}`" if s.flag else "-"
        env = f"`{s.env}`" if s.env else "-"
        rows.append(f"| `{s.field}` | {flag} | {env} | {_default_text(s)} | {s.doc} |")
    out = "\n".join(rows)
    out += "\n\n" + "\n".join(f"`{k}`: {v}." for k, v in RECORD_VARS.items())
    try:
        from custom_calls.knobs import knobs_table
    except ImportError:
        return out
    return out + "\n\n" + knobs_table()


if __name__ == "__main__":
    print(settings_table())
