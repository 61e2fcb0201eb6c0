"""Expert parallel over N devices: routed experts sharded along E, the bytes of one device.

`baro_jax.load(..., devices=N)` (CLI `--devices N`) puts every layer's routed experts
(`moe.gate_up` [E, 2I, D], `moe.down` [E, D, I]) on a 1-D mesh ("e") with
`NamedSharding(mesh, P("e"))`: device j holds experts j*E/N .. (j+1)*E/N - 1. Every other
weight, the rope tables, the state and the activations are replicated (`P()`).

Each MoE call is a `shard_map` over the mesh. Per device (nothing but the routed experts is
sharded):
1. `ops.moe_pairs` on the device's own experts: the MoE kernel's routing (expert ids and
   renormalised weights, the same code as `moe`, so the same on every device), and each
   (row, slot) pair's expert output if that expert is local, 0 otherwise. A pair's output is
   computed by the same row code as in the one-device kernel, on the one device that holds
   its expert.
2. `all_gather` of the [m, k, D] pair outputs over "e", rounded to bf16 first: the combine
   rounds every pair row to bf16 before it weighs it (docs/NUMERICS.md, moe step 3), so bf16
   rows on the link give its bytes with half the traffic; it moves rows and sums nothing.
3. each pair's row is SELECTED from its expert's owner (`jnp.where` on the owner index, no
   addition), so every device holds the one-device pair outputs, bit for bit.
4. `ops.moe_combine`: the kernel's own slot-order combine and gated shared expert.
The experts never move; the only collective is (2), and it reduces nothing, so no sum's order
depends on N: N devices give one device's bytes (tests/test_expert_parallel.py).

On a mesh of one device every expert is local and no pair crosses a device, so the MoE is the
one-device kernel `ops.moe` itself: `moe_pairs` + `moe_combine` give its bytes (the kernel test
test_moe_pairs_combine_equal_moe), but in more launches and without the one-token fold, which
cost the H200 11% of prefill and 26% of decode at N = 1 (speed_ep1pairs_device_3302a06_h200.json).
`settings.ep_pairs` (BARO_EP_PAIRS=on) keeps the per-pair kernels at N = 1, to measure or test them
on one device.

Traffic per MoE call: N x m x k x D bf16 per device (decode: 32 KB x N at Qwen3.5 widths).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .checks import as_int
from .runner import Runner
from .staging import is_expert_target

AXIS = "e"
EXPERT_KEYS = ("gate_up", "down")


def check_request(n, mode: str, backend: str, variant: str | None = None) -> int:
    """n as an int, or a clear error: a device count this host has, resident mode, the ordered
    kernels (load() and shard() both ask)."""
    n = as_int("devices (--devices)", n, lo=1)
    devs = jax.devices()
    if n > len(devs):
        raise ValueError(f"devices (--devices) {n}: this host has {len(devs)} {devs[0].platform} device(s)")
    if mode != "resident":
        raise ValueError(f"devices (--devices) {n}: expert parallel runs in resident mode, not {mode!r}")
    if backend != "ordered" or variant:
        raise ValueError(f"devices (--devices) {n}: expert parallel runs the ordered kernels; "
                         f"got backend {backend!r}" + (f" with variant {variant!r}" if variant else ""))
    return n


def make_mesh(n: int) -> Mesh:
    return Mesh(jax.devices()[:n], (AXIS,))


def check_divisible(num_experts: int, n: int):
    if num_experts % n:
        raise ValueError(f"devices (--devices) {n} must divide the number of routed experts E={num_experts}")


def shard_params(params, mesh: Mesh):
    """Routed experts sharded along E over the mesh; everything else replicated on it."""
    n = mesh.devices.size
    rep = NamedSharding(mesh, P())
    ex = NamedSharding(mesh, P(AXIS))
    experts = []
    for lp in params["layers"]:
        for k in EXPERT_KEYS:
            check_divisible(lp["moe"][k].shape[0], n)
            experts.append(lp["moe"][k])
    is_expert = {id(a) for a in experts}
    return jax.tree.map(lambda a: jax.device_put(a, ex if id(a) in is_expert else rep), params)


def place_layer_experts(layer: dict, mesh: Mesh) -> dict:
    """One layer's params with its routed experts sharded over the mesh as they are made or read,
    so no device ever holds all of a model's experts (the point of expert parallel)."""
    ex = NamedSharding(mesh, P(AXIS))
    moe = dict(layer["moe"])
    for k in EXPERT_KEYS:
        check_divisible(moe[k].shape[0], mesh.devices.size)
        moe[k] = jax.device_put(moe[k], ex)
    return {**layer, "moe": moe}


def place_tensor(target: tuple, a, mesh: Mesh):
    """A checkpoint tensor (weights.py target path) straight to its place on the mesh."""
    return jax.device_put(a, NamedSharding(mesh, P(AXIS) if is_expert_target(target) else P()))


def owner_select(y_all, owner):
    """y_all [N, m, k, D] (device j's pair outputs), owner [m, k] -> [m, k, D]: each pair's row
    from its owner, by selects only (no addition: a sum with zeros could flip a -0)."""
    out = y_all[0]
    for j in range(1, y_all.shape[0]):
        out = jnp.where((owner == j)[..., None], y_all[j], out)
    return out


class ExpertParallelOps:
    """The ordered ops with `moe` run expert-parallel over the mesh (module docstring).

    pairs: run the per-pair kernels and the all-gather (None: on more than one device); otherwise
    the one-device `moe`, the same bytes.
    Hashable on (base ops module, mesh, pairs), so it is a valid static jit argument like an ops module."""

    def __init__(self, base, mesh: Mesh, pairs: bool | None = None):
        for need in ("moe_pairs", "moe_combine"):
            if not hasattr(base, need):
                raise ValueError(f"expert parallel needs the ordered backend's {need} kernel; "
                                 f"{getattr(base, '__name__', base)!r} has none (use backend='ordered')")
        self._base = base
        self.mesh = mesh
        self.pairs = mesh.devices.size > 1 if pairs is None else bool(pairs)
        self.__name__ = (f"{getattr(base, '__name__', 'ops')}+expert_parallel[{mesh.devices.size}"
                         f"{'' if self.pairs else ', one-device moe'}]")

    def __getattr__(self, name):
        if name.startswith("_") or name == "moe_slots":  # a slot pool would need its own sharding design: not offered
            raise AttributeError(name)
        return getattr(self._base, name)

    def __hash__(self):
        return hash((self._base, self.mesh, self.pairs))

    def __eq__(self, other):
        return (isinstance(other, ExpertParallelOps) and other._base is self._base and other.mesh == self.mesh
                and other.pairs == self.pairs)

    def moe(self, h, router, gate_up, down, shared_gate_up, shared_down, shared_gate, *, top_k):
        base = self._base
        if not self.pairs:  # one device holds every expert (module docstring)
            return base.moe(h, router, gate_up, down, shared_gate_up, shared_down, shared_gate, top_k=top_k)

        def body(h, router, gu, dn, sgu, sdn, sg):
            el = gu.shape[0]  # experts per device
            first = (jax.lax.axis_index(AXIS) * el).astype(jnp.int32).reshape(1)
            y, w, ids = base.moe_pairs(h, router, gu, dn, first, top_k=top_k)
            # [N, m, k, D] in bf16, the rounding the combine applies anyway: moves rows, sums nothing
            y_all = jax.lax.all_gather(y.astype(jnp.bfloat16), AXIS)
            y = owner_select(y_all, ids // el).astype(jnp.float32)
            return base.moe_combine(h, y, w, sgu, sdn, sg)

        rep = P()
        f = jax.shard_map(body, mesh=self.mesh, in_specs=(rep, rep, P(AXIS), P(AXIS), rep, rep, rep),
                          out_specs=rep, check_vma=False)
        return f(h, router, gate_up, down, shared_gate_up, shared_down, shared_gate)


class ExpertParallelRunner(Runner):
    """Resident mode on a mesh: the routed experts sharded along E (shard_params), everything else
    replicated, the MoE run by ExpertParallelOps; the same jitted graphs as ResidentRunner."""

    placement = "resident"

    def __init__(self, cfg, params, ops, settings, mesh: Mesh):
        n = mesh.devices.size
        check_divisible(cfg.num_experts, n)
        ep_ops = ExpertParallelOps(ops, mesh, settings.ep_pairs)
        super().__init__(cfg, shard_params(params, mesh), ep_ops, settings)
        self.mesh, self.devices = mesh, n
        rep = NamedSharding(mesh, P())
        self.rope = jax.device_put(self.rope, rep)
        self.token_sharding = rep

    def new_state(self, length: int):
        return jax.device_put(super().new_state(length), self.token_sharding)


def shard(engine, n: int, mesh: Mesh | None = None, pairs: bool | None = None):
    """A new Engine on `engine`'s weights placed on an n-device mesh (experts sharded, weights
    already there stay) with its MoE run expert-parallel: what load(devices=n) builds.
    pairs: see ExpertParallelOps (None: settings.ep_pairs, else on above one device)."""
    s = engine.settings
    n = check_request(n, s.mode, engine.backend, s.variant)
    mesh = mesh if mesh is not None else make_mesh(n)
    settings = s.replace(devices=n, ep_pairs=pairs if pairs is not None else s.ep_pairs)
    runner = ExpertParallelRunner(engine.cfg, engine.params, engine.ops, settings, mesh)
    return engine.with_runner(runner, settings)
