"""Expert-sharded weights over N devices (issue 14, first CPU step): NOT yet wired into load().

What this module does
---------------------
The routed experts of every layer (`layers[i]["moe"]["gate_up"]` [E, 2I, D] and
`["down"]` [E, D, I]) are stored sharded over a 1-D mesh ("e") along the expert
axis (`NamedSharding(mesh, P("e"))`, device j holds experts j*E/N .. (j+1)*E/N - 1);
every other weight, the state and the activations are replicated.

At each MoE call, inside `shard_map`, the layer's expert shards are brought to every
device with ONE collective, `all_gather(..., tiled=True)`: it moves bf16 rows and sums
nothing, so its result is the unsharded [E, ...] tensor bit for bit, whatever N. Then
every device runs the unchanged ordered MoE kernel (`ops.moe`) on identical inputs, so
each device's output is the one-device output, bytes and all. No collective reduces.

What it does NOT do (see docs/EXPERT_PARALLEL.md)
-------------------------------------------------
This is expert-sharded STORAGE with replicated compute: the memory at rest per device
is 1/N of the routed experts (the point of issue 14: a model that does not fit one
card), but a layer's full experts are alive on every device for the duration of its
MoE call, and every device computes every (token, slot) pair. True expert-parallel
compute (each device computes only the pairs of its own experts, all-gathers per-pair
outputs, combines in slot order) needs a per-pair output op that custom_calls/moe.py
does not expose (it has moe, moe_slots, moe_route; none returns per-pair expert outputs).
"""
from __future__ import annotations

from functools import partial

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "e"
EXPERT_KEYS = ("gate_up", "down")


def make_mesh(n: int) -> Mesh:
    devs = jax.devices()
    if not 1 <= n <= len(devs):
        raise ValueError(f"devices={n}: this host has {len(devs)} {devs[0].platform} device(s)")
    return Mesh(devs[:n], (AXIS,))


def check_divisible(num_experts: int, n: int):
    if num_experts % n:
        raise ValueError(f"devices={n} must divide the number of routed experts E={num_experts}")


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


class ExpertShardedOps:
    """The base ops with `moe` run through the mesh (experts all-gathered, then the same kernel).

    Hashable on (base ops module, mesh), so it is a valid static jit argument like an ops module."""

    def __init__(self, base, mesh: Mesh):
        self._base = base
        self.mesh = mesh
        self.__name__ = f"{getattr(base, '__name__', 'ops')}+expert_sharded[{mesh.devices.size}]"

    def __getattr__(self, name):
        if name.startswith("_") or name == "moe_slots":  # a slot pool would need its own sharding design: not offered
            raise AttributeError(name)
        return getattr(self._base, name)

    def __hash__(self):
        return hash((self._base, self.mesh))

    def __eq__(self, other):
        return isinstance(other, ExpertShardedOps) and other._base is self._base and other.mesh == self.mesh

    def moe(self, h, router, gate_up, down, shared_gate_up, shared_down, shared_gate, *, top_k):
        base = self._base

        def body(h, router, gu, dn, sgu, sdn, sg):
            gu = jax.lax.all_gather(gu, AXIS, axis=0, tiled=True)  # moves rows, sums nothing
            dn = jax.lax.all_gather(dn, AXIS, axis=0, tiled=True)
            return base.moe(h, router, gu, dn, sgu, sdn, sg, top_k=top_k)

        rep = P()
        f = jax.shard_map(body, mesh=self.mesh, in_specs=(rep, rep, P(AXIS), P(AXIS), rep, rep, rep),
                          out_specs=rep, check_vma=False)
        return f(h, router, gate_up, down, shared_gate_up, shared_down, shared_gate)


def shard_engine(eng, n: int):
    """Put a resident Engine's weights on an n-device mesh (experts sharded) and route its MoE
    through the mesh. Experimental: not wired into load()/--devices (docs/EXPERT_PARALLEL.md)."""
    from . import engine as E

    if eng.mode != "resident":
        raise ValueError("expert sharding is for resident mode")
    mesh = make_mesh(n)
    eng.mesh = mesh
    eng.ops = ExpertShardedOps(eng.ops, mesh)
    eng.params = shard_params(eng.params, mesh)
    rep = NamedSharding(mesh, P())
    eng.rope = jax.device_put(eng.rope, rep)
    eng._step = partial(E._STEP, cfg=eng.cfg, ops=eng.ops)
    eng._all_logits = partial(E._ALL_LOGITS, cfg=eng.cfg, ops=eng.ops)
    new_state = eng.new_state
    eng.new_state = lambda length=None: jax.device_put(new_state(length), rep)
    return eng
