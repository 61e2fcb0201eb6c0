"""baro_jax: Qwen3.5-MoE / Qwen3-Next inference in JAX whose batched prefill matches token-by-token decode bit for bit.

The names below load on first use (PEP 562), so `python -m baro_jax` reaches the CLI, and its
Ctrl-C handling, before jax is imported."""
import importlib

_NAMES = {
    "Config": "config", "ConfigError": "config", "load_config": "config", "preset": "config",
    "Engine": "engine", "GenerateResult": "results", "PrefillResult": "results",
    "load": "loading", "Sampling": "sampling", "Settings": "settings", "SettingsError": "settings",
}
__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'baro_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
