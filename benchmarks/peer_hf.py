"""Peer arm of the speed benchmark: transformers prefill at the shapes of a baro_jax model.

    python benchmarks/peer_hf.py --model qwen3.5-35b-a3b --lengths 1024,8192,32768 --json peer.json
    python benchmarks/peer_hf.py --model tiny-random --device cpu --lengths 64,128   # smoke test

The model is the text-only causal LM of transformers (Qwen3_5MoeForCausalLM for qwen3_5_moe,
Qwen3NextForCausalLM for qwen3_next), configured from baro_jax's config for --model (a preset,
`tiny`, or a checkpoint directory's config.json; weights are always random), built directly on
--device in --dtype with transformers' default init skipped, then filled in place with the same
scales as baro_jax/synthetic.py (so routing is as non-uniform as in our arm):
matrices N(0, 1/fan_in), router 2x, lm_head 4x, embeddings N(0, 1), zero-centred norms 0.1 N,
the gated norm 1 + 0.1 N, conv taps 0.5 N, A_log = log U(1, 16), dt_bias = softplus^-1(dt) with
dt log-uniform in [1e-3, 1e-1].

Options as a user would set them for speed: attn_implementation="sdpa",
experts_implementation="grouped_mm", and FLA's chunk_gated_delta_rule when `fla` imports.
transformers binds the delta-rule kernel at import of the modeling module
(`use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")`: FLA's function if
`fla.ops.gated_delta_rule` imports, else the reference torch function). This script reads that
binding from the wrapper's closure and swaps in a counting shim, so the JSON records which
function ran and how many times it was called in one timed forward ("gdn_kernels"). On CUDA a
torch fallback is an error (exit 2, JSON still written) unless --allow-torch-fallback.

Prefill as a real one: one forward over the whole prompt (random ids, batch 1), use_cache=True
(a fresh DynamicCache each run, as generate() would make), logits_to_keep=1, under
torch.inference_mode(). The first forward at each length is warm-up (triton compiles and
autotunes there; its time is recorded as first_forward_s), then --repeats timed forwards;
tokens_per_s comes from the median wall time (perf_counter around torch.cuda.synchronize);
the median CUDA-event time is recorded too. Peak memory per length is torch's
max_memory_allocated after reset_peak_memory_stats.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
T0 = time.perf_counter()


def log(msg: str):
    print(f"[peer {time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def baro_config_module():
    """baro_jax/config.py by path: only the stdlib, no jax import, no baro_jax package init."""
    spec = importlib.util.spec_from_file_location("_baro_config", os.path.join(ROOT, "baro_jax", "config.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module by name
    spec.loader.exec_module(mod)
    return mod


def baro_cfg(model: str):
    C = baro_config_module()
    if model in C.PRESETS:
        return C.preset(model)
    path = os.path.join(ROOT, "baro_jax", "checkpoints", "tiny") if model == "tiny" else model
    if os.path.isdir(path):
        return C.load_config(path)
    raise SystemExit(f"--model {model!r}: neither a preset ({', '.join(C.PRESETS)}), 'tiny', nor a checkpoint directory")


def hf_text_config(cfg, max_positions: int, attn: str, experts: str):
    """The transformers text config with the shapes of a baro_jax Config."""
    import transformers as T

    kw = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        layer_types=list(cfg.layer_types), num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.lin_k_heads, linear_num_value_heads=cfg.lin_v_heads,
        linear_key_head_dim=cfg.lin_k_dim, linear_value_head_dim=cfg.lin_v_dim,
        linear_conv_kernel_dim=cfg.conv_kernel, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.moe_inter,
        shared_expert_intermediate_size=cfg.shared_inter, rms_norm_eps=cfg.rms_eps,
        max_position_embeddings=max(max_positions, 4096), tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor},
        attn_implementation=attn, experts_implementation=experts, use_cache=True,
    )
    if cfg.model_type == "qwen3_next":
        return T.Qwen3NextConfig(**kw, norm_topk_prob=True), T.Qwen3NextForCausalLM
    return T.Qwen3_5MoeTextConfig(**kw), T.Qwen3_5MoeForCausalLM


def modeling_module(cfg):
    import importlib

    name = "qwen3_next" if cfg.model_type == "qwen3_next" else "qwen3_5_moe"
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


# --- which kernel transformers bound, and a counter on it ---------------------------------

def _fallback_closure(fn):
    """The closure cells of the use_kernel_func_from_hub_with_fallback wrapper behind fn."""
    seen, f = set(), fn
    while f is not None and id(f) not in seen:
        seen.add(id(f))
        code = getattr(f, "__code__", None)
        if code is not None and "implementation" in code.co_freevars and f.__closure__:
            return dict(zip(code.co_freevars, f.__closure__))
        f = getattr(f, "__wrapped__", None)
    return None


class KernelProbe:
    """Reads the implementation bound to a module-level kernel wrapper and counts its calls."""

    def __init__(self, module, attr: str):
        self.attr = attr
        self.calls = 0
        fn = getattr(module, attr, None)
        cells = _fallback_closure(fn) if fn is not None else None
        if cells is None:
            self.impl, self.counting = fn, False
            self.note = "no fallback wrapper found (transformers layout changed?); calls not counted"
            return
        impl = cells["implementation"].cell_contents
        self.impl, self.counting, self.note = impl, True, ""
        probe = self

        def counted(*a, **k):
            probe.calls += 1
            return impl(*a, **k)

        cells["implementation"].cell_contents = counted  # the wrapper looks it up at call time

    @property
    def where(self) -> str:
        f = self.impl
        return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', getattr(f, '__name__', '?'))}"

    @property
    def is_fla(self) -> bool:
        return self.where.startswith("fla.")

    def record(self) -> dict:
        r = {"function": self.where, "calls_counted": self.counting}
        if self.note:
            r["note"] = self.note
        return r


# --- weights ------------------------------------------------------------------------------

def fill_random_(model, seed: int, device):
    """baro_jax/synthetic.py's scales, drawn on the device (see the module docstring)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    D = model.config.hidden_size
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0, generator=g)
        elif name == "lm_head.weight":
            p.normal_(0.0, 4.0 / math.sqrt(D), generator=g)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 2.0 / math.sqrt(D), generator=g)
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
        elif name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain weight
            p.normal_(1.0, 0.1, generator=g)
        elif name.endswith("norm.weight"):  # zero-centred RMSNorms (scale 1 + w)
            p.normal_(0.0, 0.1, generator=g)
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 0.5, generator=g)
        elif name.endswith("A_log"):
            u = torch.rand(p.shape, generator=g, device=device, dtype=torch.float32)
            p.copy_(torch.log1p(15.0 * u))
        elif name.endswith("dt_bias"):
            u = torch.rand(p.shape, generator=g, device=device, dtype=torch.float32)
            dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif p.ndim == 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=g)
        else:
            raise AssertionError(f"fill_random_: no rule for {name} {tuple(p.shape)}")


def build_model(cfg, args, device):
    import torch
    import transformers

    hf_cfg, cls = hf_text_config(cfg, max(args.lengths) + 16, args.attn, args.experts)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older layout
        from transformers.modeling_utils import no_init_weights
    dtype = getattr(torch, args.dtype)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), no_init_weights():
            model = cls(hf_cfg)
    finally:
        torch.set_default_dtype(prev)
    model.eval()  # params were made in dtype on device; float32 buffers (rope inv_freq) stay float32
    with torch.no_grad():
        fill_random_(model, args.seed, device)
    n_params = sum(p.numel() for p in model.parameters())
    return model, n_params, transformers.__version__


def versions() -> dict:
    import torch
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
         "torch_cuda": torch.version.cuda}
    for mod in ("triton", "fla", "einops", "causal_conv1d"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001  (absent, or broken: say which)
            v[mod] = None if isinstance(e, ModuleNotFoundError) else f"import error: {type(e).__name__}: {e}"
    return v


def fla_import_status() -> dict:
    """Whether FLA's delta-rule module imports here, and why not (transformers hides the error)."""
    try:
        import fla.ops.gated_delta_rule as m  # noqa: F401
        return {"imports": True, "file": getattr(m, "__file__", None)}
    except Exception as e:  # noqa: BLE001
        return {"imports": False, "error": f"{type(e).__name__}: {e}"}


def time_prefill(model, ids, repeats: int, device) -> dict:
    import torch

    cuda = device.type == "cuda"

    def once():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return out.logits

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    t = time.perf_counter()
    logits = once()
    sync()
    first = time.perf_counter() - t
    assert logits.shape[1] == 1, logits.shape
    finite = bool(torch.isfinite(logits).all())
    del logits
    walls, events = [], []
    for _ in range(repeats):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync()
        t = time.perf_counter()
        if cuda:
            e0.record()
        lg = once()
        if cuda:
            e1.record()
        sync()
        walls.append(time.perf_counter() - t)
        if cuda:
            events.append(e0.elapsed_time(e1) / 1e3)
        del lg
    n = ids.shape[1]
    med = statistics.median(walls)
    r = {"tokens_per_s": n / med, "seconds_median": med, "seconds_all": walls, "first_forward_s": first,
         "repeats": repeats, "last_logits_finite": finite}
    if events:
        r["cuda_event_seconds_median"] = statistics.median(events)
        r["cuda_event_seconds_all"] = events
    if cuda:
        r["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="baro_jax preset, 'tiny', or a checkpoint dir")
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per length (median)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--attn", default="sdpa", help="attn_implementation")
    ap.add_argument("--experts", default="grouped_mm", help="experts_implementation")
    ap.add_argument("--allow-torch-fallback", action="store_true",
                    help="on CUDA, time the reference torch delta rule instead of failing when FLA is absent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]

    out = {"summary": {"arm": "peer-hf", "model": args.model, "dtype": args.dtype, "device_arg": args.device,
                       "attn_implementation_requested": args.attn,
                       "experts_implementation_requested": args.experts,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "host": platform.node(), "partial": True},
           "rows": []}

    def dump():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    rc = 0
    try:
        import numpy as np
        import torch

        out["summary"]["fla_import"] = fla_import_status()  # before transformers binds its kernels
        out["summary"]["versions"] = versions()
        log(f"versions {out['summary']['versions']}")
        device = torch.device(args.device)
        if device.type == "cuda":
            out["summary"]["device"] = f"cuda:{torch.cuda.get_device_name(device)}"
            out["summary"]["device_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
        else:
            out["summary"]["device"] = f"cpu:{platform.processor() or platform.machine()}"
            out["summary"]["cpu_threads"] = torch.get_num_threads()
        cfg = baro_cfg(args.model)
        mm = modeling_module(cfg)
        probes = {"chunk_gated_delta_rule": KernelProbe(mm, "torch_chunk_gated_delta_rule"),
                  "causal_conv1d_fn": KernelProbe(mm, "causal_conv1d_fn")}
        gdn = probes["chunk_gated_delta_rule"]
        out["summary"]["fla_used"] = gdn.is_fla
        out["summary"]["gdn_kernels"] = {k: p.record() for k, p in probes.items()}
        log(f"chunk_gated_delta_rule -> {gdn.where}  (FLA: {gdn.is_fla}); "
            f"causal_conv1d_fn -> {probes['causal_conv1d_fn'].where}")
        if device.type == "cuda" and not gdn.is_fla and not args.allow_torch_fallback:
            out["summary"]["error"] = (f"FLA is not used: chunk_gated_delta_rule is bound to {gdn.where} "
                                       f"(fla import: {out['summary']['fla_import']}); refusing to time the torch "
                                       "reference as the peer (pass --allow-torch-fallback to time it anyway)")
            log("ERROR " + out["summary"]["error"])
            dump()
            return 2

        t = time.perf_counter()
        model, n_params, _ = build_model(cfg, args, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out["summary"].update(
            build_seconds=time.perf_counter() - t, n_params=n_params, hf_class=type(model).__name__,
            attn_implementation=model.config._attn_implementation,
            experts_implementation=getattr(model.config, "_experts_implementation", None),
            weights_memory_gb=(torch.cuda.memory_allocated(device) / 1e9) if device.type == "cuda" else None)
        log(f"built {type(model).__name__} {n_params / 1e9:.2f}B params on {device} in "
            f"{out['summary']['build_seconds']:.1f}s (attn {out['summary']['attn_implementation']}, "
            f"experts {out['summary']['experts_implementation']})")
        if out["summary"]["experts_implementation"] != args.experts or out["summary"]["attn_implementation"] != args.attn:
            log("WARNING: transformers changed the requested attention/experts implementation")

        rng = np.random.default_rng(args.seed)
        with torch.inference_mode():
            for n in args.lengths:
                ids = torch.as_tensor(rng.integers(0, min(cfg.vocab_size, 256), (1, n)), dtype=torch.long,
                                      device=device)
                for p in probes.values():
                    p.calls = 0
                r = time_prefill(model, ids, args.repeats, device)
                forwards = 1 + args.repeats
                r["kernel_calls_per_forward"] = {k: p.calls / forwards for k, p in probes.items() if p.counting}
                row = {"prompt_tokens": n, "peer-hf": r}
                out["rows"].append(row)
                log(f"n={n:>6} peer-hf: {r['tokens_per_s']:10.1f} tok/s  median {r['seconds_median']:.3f}s  "
                    f"first {r['first_forward_s']:.1f}s  peak {r.get('peak_memory_gb', 0):.1f} GB  "
                    f"calls/forward {r['kernel_calls_per_forward']}")
                dump()
        n_lin = sum(t == "linear_attention" for t in cfg.layer_types)
        calls = [row["peer-hf"]["kernel_calls_per_forward"].get("chunk_gated_delta_rule") for row in out["rows"]]
        out["summary"]["gdn_layers"] = n_lin
        out["summary"]["gdn_calls_match_layers"] = all(c == n_lin for c in calls) if gdn.counting else None
    except Exception as e:  # noqa: BLE001  (the JSON says what failed)
        out["summary"]["error"] = f"{type(e).__name__}: {e}"
        out["summary"]["traceback"] = traceback.format_exc()[-4000:]
        log("ERROR " + out["summary"]["error"])
        rc = 1
    out["summary"]["partial"] = rc != 0
    out["summary"]["total_seconds"] = time.perf_counter() - T0
    dump()
    return rc


if __name__ == "__main__":
    sys.exit(main())
