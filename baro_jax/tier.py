"""TierRunner: the runner of tier mode (routed experts in pinned host memory, staging.py).

Prefill runs the layers from a Python loop, each layer's experts staged onto the device while
the layer before computes. Decode takes its experts from the decode expert cache: on the
direct path (one graph per greedy block, misses read from the host store inside the MoE
call) or the cache path (per layer the routing to the host, LRU copies, then the MoE). Every
path runs model.py's functions on the same weights, so tier mode gives resident mode's bytes.
"""
from __future__ import annotations

from . import budget, staging
from .runner import Runner, to_device
from .shapes import MIN_STATE_LEN, state_length


class TierRunner(Runner):
    placement = "tier"

    def __init__(self, cfg, params, ops, settings):
        budget.check_tier(cfg, params["embed"].dtype, settings.device_budget_gb, min(MIN_STATE_LEN, cfg.max_context))
        super().__init__(cfg, staging.tier_params(params), ops, settings)  # experts to the host store (no-op where they are)
        self.cache = self.direct = None
        self.cache_note = ""
        self._slots_asked = settings.cache_slots
        self.use_expert_cache(settings.cache_slots)

    # --- the decode expert cache ------------------------------------------------------
    def use_expert_cache(self, slots: int | None = None):
        """(Re)build the decode expert cache with `slots` per layer (None: budget.tier_cache_slots'
        default; 0: none, decode stages every layer's experts); returns the cache (None: none)."""
        s = self.settings
        path = staging.pick_decode_path(s.tier_decode, self.ops, self.cfg)
        if path == "direct" and staging.has_cache_ops(self.ops) and not staging.has_host_ops(self.ops):
            raise ValueError(f"tier_decode direct (BARO_TIER_DECODE=direct): the {self.ops_name} ops cannot read "
                             "experts from the host store (use the ordered backend)")
        if slots is not None:
            slots = budget.check_cache_slots(self.cfg, slots)
        # the old pools go before the new ones are made (both at once may not fit the device)
        self.cache = self.direct = self.token_sharding = None
        self._slots_asked = slots
        if not staging.has_cache_ops(self.ops):
            self.cache_note = f"off: the {self.ops_name} ops have no slot-table MoE"
            return None
        S, self.cache_note = budget.tier_cache_slots(self.cfg, self.dtype, self.budget_gb, slots)
        if S:
            self.cache = staging.ExpertCache(self.cfg, self.params["layers"], S, fetch_path=s.tier_fetch, ops=self.ops)
            if path == "direct":
                self.direct = staging.DirectDecode(self.params, self.cache, self.ops, adaptive=s.tier_adapt)
                self.token_sharding = self.cache._on_dev  # its graphs' outputs live with the pools
        return self.cache

    @property
    def ops_name(self) -> str:
        return getattr(self.ops, "name", None) or getattr(self.ops, "__name__", "these")

    @property
    def cache_slots(self) -> int:
        return self.cache.slots if self.cache is not None else 0

    def expert_cache_report(self) -> dict:
        if self.cache is None:
            return {"slots_per_layer": 0, "note": self.cache_note}
        if self.direct is not None:  # the pools as they stood, the misses read from the host store
            return {**self.cache.stats(), **self.direct.stats(), "note": self.cache_note}  # direct's counts win
        return {**self.cache.stats(), "decode_path": "cache", "note": self.cache_note}

    def reset_stats(self):
        if self.cache is not None:
            self.cache.reset_stats()
        if self.direct is not None:
            self.direct.reset_stats()

    def recover(self):
        """A call cut short inside a cache update (Ctrl-C, an exception from a callback) can leave
        the slot tables describing copies that never landed, or a pool donated to a copy whose
        result never came back: rebuild the cache then. Its contents only decide speed, never
        bytes (every routed expert is read from a pool or the store), so a rebuilt one is as good."""
        if self.cache is not None and not self.cache.intact():
            self.use_expert_cache(self._slots_asked)

    # --- the runner interface -------------------------------------------------------------
    @property
    def decode_block(self) -> int:
        # the cache path stages experts from Python per layer and token: no device loop
        return self.settings.decode_block if self.direct is not None else 1

    @property
    def replay_block(self) -> int:
        return 1  # the replay's steps run staging.forward's layers from Python, a token at a time

    def forward(self, state, tokens, pos, n_valid, all_logits: bool = False):
        tokens, pos, n_valid = to_device(tokens, pos, n_valid)  # once, not by each layer's call
        return staging.forward(self.params, state, tokens, pos, n_valid, self.rope, cfg=self.cfg, ops=self.ops,
                               all_logits=all_logits, cache=self.cache, direct=self.direct)

    def decode_rows(self, pool, table, tokens, slots, running, pos, *, ops, guard: bool):
        """One decode row per slot of a many-sequence pool (batch.py's decode step). A step of one
        row on the direct path, in one graph (a lone sequence: the pool packs it into slot 0); else
        the layers from Python (staging.decode_rows), each layer's MoE through the decode expert
        cache, or staged whole. ops: the pool's (with attention_rows)."""
        tokens, slots, running, pos = to_device(tokens, slots, running, pos)
        if self.direct is not None and tokens.shape[0] == 1:
            return self.direct.rows(pool, table, tokens, slots, running, pos, self.rope, cfg=self.cfg, ops=ops,
                                    guard=guard)
        return staging.decode_rows(self.params, pool, table, tokens, slots, running, pos, self.rope, cfg=self.cfg,
                                   ops=ops, guard=guard, cache=self.cache, direct=self.direct)

    def mixed(self, state, tokens, pos, n_valid, pool, table, row_tokens, slots, running, row_pos, *, ops, guard: bool,
              all_logits: bool):
        """A prefill chunk and one decode row per slot in one pass (batch.py's mixed round;
        staging.mixed_forward): the layers staged whole once for both."""
        tokens, pos, n_valid, row_tokens, slots, running, row_pos = to_device(
            tokens, pos, n_valid, row_tokens, slots, running, row_pos)
        return staging.mixed_forward(self.params, state, tokens, pos, n_valid, pool, table, row_tokens, slots, running,
                                     row_pos, self.rope, cfg=self.cfg, ops=ops, guard=guard, all_logits=all_logits)

    def greedy_block(self, state, token, pos, n: int, block: int, samp=None, k_max=None):
        return self.direct.greedy(state, token, pos, n, self.rope, cfg=self.cfg, ops=self.ops, block=block, samp=samp,
                                  k_max=k_max)

    def check_budget(self, state_len: int, chunk: int = 0):
        budget.check_tier(self.cfg, self.dtype, self.budget_gb, state_len, chunk, self.cache_slots)

    def pick_chunk(self, n_prompt: int, n_new: int = 0) -> int:
        """Every pass moves all routed experts over the host link whatever the chunk, so the
        largest chunk (up to one for the whole prompt) whose activations fit beside the state."""
        L = state_length(n_prompt + n_new, self.cfg.max_context)
        return budget.largest_tier_chunk(self.cfg, self.dtype, self.budget_gb, L, n_prompt, self.cache_slots)

