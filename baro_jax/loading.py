"""baro_jax.load: a checkpoint or a preset into an Engine, its weights placed as the settings say."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from . import budget, expert_parallel, staging
from .config import PRESETS, ConfigError, load_config, preset
from .engine import RUNNERS, Engine, resolve_backend
from .ops import get_ops
from .sampling import check_seed
from .settings import Settings
from .shapes import MIN_STATE_LEN
from .synthetic import synthetic_params
from .tokenizer import ByteTokenizer, load_tokenizer
from .weights import load_params

# Trained by benchmarks/train_tiny.py (evidence in benchmarks/results/train_tiny_*).
TINY_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints", "tiny")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def load(model: str = "tiny", *, settings: Settings | None = None, seed: int = 0, progress: bool = True,
         **setting_values) -> Engine:
    """Load a checkpoint directory or a preset name into an Engine.

    model: a checkpoint directory (config.json, model.safetensors[.index.json], tokenizer files);
    "tiny", the embedded trained demonstration model; or a synthetic-weight preset at real
    shapes (qwen3.5-35b-a3b, qwen3-next-80b-a3b, tiny-random; `seed` draws its weights).

    Settings (baro_jax/settings.py, where each is documented) come as keywords or as one
    `settings=Settings.resolve(...)`; what is not given comes from the BARO_* environment, then
    the defaults: backend, dtype, mode ("resident" | "tier"), variant, delta_rule, max_context,
    device_budget_gb, devices (expert parallel over N devices), cache_slots, allow_nonfinite, ...
    Every value is checked before any weight is read.

    Refused with a message naming the file and field or tensor: a bad config.json, index or
    tokenizer file, a corrupt safetensors header, NaN/Inf weights (unless allow_nonfinite), a
    max_context beyond the model's, a model that cannot fit the device budget.
    progress: show loading progress on stderr."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a checkpoint directory or a preset name (a str), got {type(model).__name__}")
    model = os.fspath(model)
    if settings is None:
        settings = Settings.resolve(**setting_values)
    elif setting_values:
        settings = settings.replace(**setting_values)
    seed = check_seed(seed)
    settings = resolve_backend(settings)
    dtype = DTYPES[settings.dtype]
    get_ops(settings.backend)  # fail early and plainly if the backend is unavailable
    mesh = None
    if settings.devices is not None:  # refused here, before any weight is read or drawn
        n = expert_parallel.check_request(settings.devices, settings.mode, settings.backend, settings.variant)
        mesh = expert_parallel.make_mesh(n)
    if model == "tiny":  # the embedded default: a trained checkpoint, loaded like any other
        model = TINY_CHECKPOINT

    def check(cfg):  # before any weight is read or drawn
        if settings.mode == "tier":
            budget.check_tier(cfg, dtype, settings.device_budget_gb, min(MIN_STATE_LEN, cfg.max_context))
        else:
            if mesh is not None:
                expert_parallel.check_divisible(cfg.num_experts, mesh.devices.size)
            budget.check_resident(cfg, dtype, settings.device_budget_gb, devices=settings.devices or 1)
        if settings.cache_slots:
            budget.check_cache_slots(cfg, settings.cache_slots)

    if os.path.isdir(model):
        cfg = load_config(model, settings.max_context)
        check(cfg)
        place = None
        if settings.mode == "tier":  # experts straight to the host store, the rest to the device
            place = lambda t, a: staging.to_store(a) if staging.is_expert_target(t) else jax.device_put(a)  # noqa: E731
        if mesh is not None:  # each tensor straight to its place on the mesh
            place = lambda t, a: expert_parallel.place_tensor(t, a, mesh)  # noqa: E731
        params = load_params(model, cfg, dtype=dtype, progress=progress, place=place,
                             allow_nonfinite=settings.allow_nonfinite)
        tokenizer, name = load_tokenizer(model), os.path.basename(os.path.normpath(model))
    elif model in PRESETS:
        cfg = preset(model, settings.max_context)
        check(cfg)
        place_layer = staging.store_layer_experts if settings.mode == "tier" else None
        if mesh is not None:  # each layer's experts sharded as it is drawn
            place_layer = lambda lp: expert_parallel.place_layer_experts(lp, mesh)  # noqa: E731
        params = synthetic_params(cfg, seed=seed, dtype=dtype, place_layer=place_layer)
        tokenizer, name = ByteTokenizer(), model
    else:
        raise ConfigError(f"--model {model!r} is neither a checkpoint directory nor a preset "
                          f"(tiny, {', '.join(PRESETS)})")
    return make_engine(cfg, params, tokenizer, name, settings, mesh)


def make_engine(cfg, params, tokenizer, name: str, settings: Settings, mesh=None) -> Engine:
    """The Engine of `settings`' placement over weights in hand: one runner per placement."""
    cfg = dataclasses.replace(cfg, delta_rule=settings.delta_rule)
    ops = Engine._make_ops(settings)
    if mesh is not None:
        runner = expert_parallel.ExpertParallelRunner(cfg, params, ops, settings, mesh)
    else:
        runner = RUNNERS[settings.mode](cfg, params, ops, settings)
    return Engine(cfg, runner.params, tokenizer, name=name, settings=settings, runner=runner)
