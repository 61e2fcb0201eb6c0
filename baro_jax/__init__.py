"""baro_jax: Qwen3.5-MoE / Qwen3-Next inference in JAX whose batched prefill matches token-by-token decode bit for bit."""
from .config import Config, ConfigError, load_config, preset
from .engine import Engine, GenerateResult, PrefillResult
from .loading import load
from .sampling import Sampling
from .settings import Settings, SettingsError

__all__ = ["Config", "ConfigError", "Engine", "GenerateResult", "PrefillResult", "Sampling", "Settings",
           "SettingsError", "load", "load_config", "preset"]
