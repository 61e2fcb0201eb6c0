"""baro_jax: Qwen3.5-MoE / Qwen3-Next inference in JAX whose batched prefill matches token-by-token decode bit for bit."""
from .config import Config, ConfigError, load_config, preset
from .engine import Engine, GenerateResult, PrefillResult, load
from .sampling import Sampling

__all__ = ["Config", "ConfigError", "Engine", "GenerateResult", "PrefillResult", "Sampling", "load", "load_config", "preset"]
