"""The runtime's shape: settings read once and strictly, no import cycle in baro_jax, one runner
interface, and an Engine that survives threads and interruptions with the same bytes."""
import ast
import os
import re
import threading

import numpy as np
import pytest

import baro_jax
from baro_jax import settings as S
from baro_jax import staging

PKG = os.path.join(os.path.dirname(__file__), "..", "baro_jax")
README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def package_modules():
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, PKG)[:-3].replace(os.sep, ".")
                name = "baro_jax" if rel == "__init__" else "baro_jax." + rel.removesuffix(".__init__")
                out[name] = path
    return out


def imported(module: str, path: str, known: set) -> set:
    """Every baro_jax module `module` imports, at any depth of its code (function-local too)."""
    tree = ast.parse(open(path).read())
    pkg = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                base = base + ("." + node.module if node.module else "")
            else:
                base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known and n != module}
    return out


def test_baro_jax_has_no_import_cycle():
    mods = package_modules()
    graph = {m: imported(m, p, set(mods)) - {"baro_jax"} for m, p in mods.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_cycle_finder_finds_a_cycle(tmp_path):
    """The walker above sees a function-local import (what hid the old cycles)."""
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from . import b\n")
    assert imported("baro_jax.a", str(a), {"baro_jax.a", "baro_jax.b"}) == {"baro_jax.b"}


def test_only_settings_reads_the_environment():
    """Every BARO_* setting in baro_jax is read through settings.py; the names the package's code
    mentions are settings' variables or the kernel library's knobs."""
    import custom_calls.knobs as K

    known = set(S.ENV_VARS) | set(K.KNOBS)
    for mod, path in package_modules().items():
        src = open(path).read()
        if not path.endswith("settings.py"):
            assert "os.environ" not in src and "getenv" not in src, f"{mod} reads the environment itself"
        for name in set(re.findall(r"\bBARO_[A-Z0-9_]+\b", src)):
            assert name in known, f"{mod} names {name}, which is neither a setting nor a kernel knob"


def test_readme_settings_table_is_the_generated_one():
    text = open(README).read()
    m = re.search(r"<!-- settings-table -->\n(.*?)\n<!-- /settings-table -->", text, re.S)
    assert m, "README has no settings table between its markers"
    assert m.group(1).strip() == S.settings_table().strip(), \
        "README's settings table is stale: paste `python -m baro_jax.settings` between its markers"


@pytest.mark.parametrize("raw,want", [("1", True), ("TRUE", True), (" on ", True), ("yes", True),
                                      ("0", False), ("False", False), ("off", False), ("No", False)])
def test_on_off_values(raw, want):
    assert S.Settings.resolve(env={"BARO_ALLOW_NONFINITE": raw}).allow_nonfinite is want


@pytest.mark.parametrize("var,raw,msg", [
    ("BARO_ALLOW_NONFINITE", "false-ish", "BARO_ALLOW_NONFINITE must be on or off"),
    ("BARO_EP_PAIRS", "abc", "BARO_EP_PAIRS must be on or off"),
    ("BARO_TIER", "2", "BARO_TIER must be on or off"),
    ("BARO_PREFILL", "batch", "BARO_PREFILL must be on or off"),
    ("BARO_PREFILL_C", "0", "BARO_PREFILL_C must be >= 1"),
    ("BARO_PREFILL_C", "8k", "BARO_PREFILL_C must be an integer"),
    ("BARO_DECODE_BLOCK", "5000", "BARO_DECODE_BLOCK must be <= 4096"),
    ("BARO_CACHE_SLOTS", "-1", "BARO_CACHE_SLOTS must be >= 0"),
    ("BARO_VARIANT", "fast", "BARO_VARIANT must be one of xla, attn-fast, delta-chunk, none"),
    ("BARO_DELTA", "chunked", "BARO_DELTA must be one of token, blocked"),
    ("BARO_TIER_DECODE", "fast", "BARO_TIER_DECODE must be one of auto, cache, direct"),
    ("BARO_ATTN_IMPL", "flash", "BARO_ATTN_IMPL must be one of auto, xla, cudnn"),
    ("BARO_TRACEBACK", "please", "BARO_TRACEBACK must be on or off"),
])
def test_bad_environment_values_name_the_variable(var, raw, msg):
    with pytest.raises(S.SettingsError, match=re.escape(msg)):
        S.Settings.resolve(env={var: raw})


@pytest.mark.parametrize("given,msg", [
    (dict(device_budget_gb=float("nan")), "device_budget_gb (--device-budget-gb) must be a finite number > 0"),
    (dict(device_budget_gb=-1), "must be a finite number > 0"),
    (dict(chunk=True), "chunk (--chunk) must be an integer"),
    (dict(chunk=2.0), "chunk (--chunk) must be an integer"),
    (dict(mode="tiered"), "mode (--mode) must be one of resident, tier"),
    (dict(variant="delta-chunk", delta_rule="blocked"), "cannot run with delta_rule blocked"),
    (dict(cache_slots=4), "cache_slots (--cache-slots) sizes tier mode"),
    (dict(devices=2, mode="tier"), "expert parallel runs in resident mode"),
    (dict(backend="ordered", dtype="float32"), "runs bfloat16 only"),
])
def test_bad_arguments_name_the_setting(given, msg):
    with pytest.raises((S.SettingsError, TypeError), match=re.escape(msg)):
        S.Settings.resolve(env={}, **given)


def test_arguments_win_over_the_environment_and_settings_are_frozen():
    s = S.Settings.resolve(env={"BARO_TIER": "on", "BARO_DECODE_BLOCK": "4"}, mode="resident")
    assert s.mode == "resident" and s.decode_block == 4
    with pytest.raises(Exception):
        s.mode = "tier"
    with pytest.raises(TypeError, match="unknown setting"):
        S.Settings.resolve(env={}, modes="tier")


def test_new_state_names_max_context():
    eng = baro_jax.load("tiny", max_context=64, progress=False)
    with pytest.raises(ValueError, match="max_context of 64"):
        eng.new_state(256)


def test_new_state_is_init_state_in_one_graph():
    """The engine's fresh state comes from one jitted graph: model.init_state's layout, dtypes and
    zero bytes, every leaf its own buffer (prefill donates them), and a second state of the same
    length compiles nothing new."""
    import jax

    from baro_jax import model as M
    from baro_jax import runner as R

    eng = baro_jax.load("tiny", max_context=256, progress=False)
    ref = M.init_state(eng.cfg, eng.dtype, 128)
    got = eng.new_state(128)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert np.asarray(g).tobytes() == np.asarray(r).tobytes()
    ptrs = [leaf.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(got)]
    assert len(set(ptrs)) == len(ptrs)
    before = R.ZERO_STATE._cache_size()
    eng.new_state(128)
    assert R.ZERO_STATE._cache_size() == before
    eng.new_state(64)
    assert R.ZERO_STATE._cache_size() == before + 1


def test_tune_changes_only_what_moves_no_weight():
    eng = baro_jax.load("tiny", progress=False)
    eng.tune(decode_block=3)
    assert eng.settings.decode_block == 3
    with pytest.raises(ValueError, match="cannot change on a loaded engine"):
        eng.tune(mode="tier")


# --- an engine that survives threads and interruptions -------------------------------------------
PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n"
NEW = 12


@pytest.fixture(scope="module", params=["cache", "direct"])
def tier(request):
    eng = baro_jax.load("tiny", mode="tier", backend="ordered", progress=False)
    eng.tune(tier_decode=request.param)
    eng.use_expert_cache(eng.cfg.top_k + 1)  # small pools: misses and evictions every token
    return eng


def reference(eng, n=NEW):
    r = eng.generate(PROMPT, n, stop_at_eos=False)
    return r.generated_ids, r.last_prompt_logits.tobytes()


def test_an_exception_in_a_callback_leaves_the_engine_usable(tier):
    want = reference(tier)

    class Stop(Exception):
        pass

    def on_token(t):
        if len(seen) == 5:
            raise Stop
        seen.append(t)

    seen = []
    with pytest.raises(Stop):
        tier.generate(PROMPT, NEW, stop_at_eos=False, on_token=on_token)
    assert seen == want[0][:5]
    assert reference(tier) == want


def test_an_interrupt_inside_a_cache_copy_leaves_the_engine_usable(tier, monkeypatch):
    """KeyboardInterrupt after a copy was dispatched but before its pools came back (the donated
    buffers are gone, the tables already name the new experts): the engine rebuilds its cache and
    gives the same bytes afterwards. Cut at several copies, so some land mid-decode."""
    n = 40  # long enough for direct decode to adapt its pools (copies) between blocks
    want = reference(tier, n)
    real = staging.ExpertCache._copy
    for cut in ((1, 3, 9) if tier.settings.tier_decode == "cache" else (1, 2)):  # direct copies only as it adapts
        calls = []

        def copy(self, layer, experts, slots):
            calls.append(layer)
            real(self, layer, experts, slots)
            if len(calls) == cut:
                for pool in self.pools[layer]:
                    pool.delete()  # what a donation whose result never arrived leaves
                raise KeyboardInterrupt

        monkeypatch.setattr(staging.ExpertCache, "_copy", copy)
        tier.runner.reset_stats()
        try:
            tier.generate(PROMPT, n, stop_at_eos=False)
        except KeyboardInterrupt:
            pass
        monkeypatch.setattr(staging.ExpertCache, "_copy", real)
        assert len(calls) >= cut, f"only {len(calls)} copies: the cut at {cut} was not reached"
        assert tier.runner.cache.intact()
        assert reference(tier, n) == want, f"bytes changed after an interrupt at copy {cut}"


def test_threads_share_one_engine(tier):
    """Calls from several threads run one at a time and each gets its own request's bytes."""
    prompts = [PROMPT, "import os\n", "class A:\n    def", PROMPT[:20]]
    want = [tier.generate(p, 8, stop_at_eos=False).generated_ids for p in prompts]
    got = [None] * (2 * len(prompts))
    errors = []

    def work(i):
        try:
            got[i] = tier.generate(prompts[i % len(prompts)], 8, stop_at_eos=False).generated_ids
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(got))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == want + want


def test_prefill_zeroes_a_used_state():
    eng = baro_jax.load("tiny", progress=False)
    ids = eng.encode(PROMPT)
    fresh = np.asarray(eng.prefill(ids).logits)
    used = eng.prefill(ids[:7]).state
    again = eng.prefill(ids, state=used)
    assert np.asarray(again.logits).tobytes() == fresh.tobytes()
    with pytest.raises(ValueError, match="already consumed"):
        eng.prefill(ids, state=used)


def test_forced_logits_checks_state_len():
    eng = baro_jax.load("tiny", progress=False)
    ids = eng.encode(PROMPT)
    with pytest.raises(ValueError, match=f"state_len must hold the {len(ids)} ids"):
        eng.forced_logits(ids, state_len=len(ids) - 1)
    with pytest.raises(TypeError, match="state_len must be an integer"):
        eng.forced_logits(ids, state_len=64.0)


def test_replay_progress_reaches_the_whole_prompt():
    eng = baro_jax.load("tiny", progress=False)
    seen = []
    eng.prefill([i % 200 + 40 for i in range(300)], "replay", progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1] == (300, 300) and all(d <= t for d, t in seen)


def test_replay_in_device_blocks_has_the_bytes_of_one_step_a_call():
    """The replay prefill runs all but the last token in device calls of decode_block teacher-fed
    steps (no logits computed in them): its logits and state are the bytes of one decode step a
    call (decode_block 1), for prompts shorter than a block, a block and one past, and several
    blocks with a remainder; progress still reports every 256 tokens and the whole prompt."""
    import jax

    def leaves(st):
        return b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(st))

    eng = baro_jax.load("tiny", progress=False)
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % (1 << 32)))
    old = eng.settings.decode_block
    try:
        for n in (1, 5, 16, 17, 33, 300):
            ids = [int(t) for t in rng.integers(0, eng.cfg.vocab_size, n)]
            got = {}
            for b in (1, 16):
                eng.tune(decode_block=b)
                seen = []
                pre = eng.prefill(ids, "replay", progress=lambda d, t: seen.append(d))
                got[b] = (np.asarray(pre.logits).tobytes(), leaves(pre.state))
                assert seen[-1] == n and all(d % 256 == 0 for d in seen[:-1]), (n, b, seen)
            assert got[16] == got[1], n
    finally:
        eng.tune(decode_block=old)


@pytest.mark.parametrize("kw,msg", [(dict(on_token=3), "on_token must be a callable"),
                                    (dict(progress="yes"), "progress must be a callable"),
                                    (dict(top_k=5), "temperature is 0"),
                                    (dict(sampling=baro_jax.Sampling(), seed=3), "not both")])
def test_generate_refuses_bad_arguments_before_any_work(kw, msg, monkeypatch):
    eng = baro_jax.load("tiny", progress=False)
    monkeypatch.setattr(eng, "prefill", lambda *a, **k: pytest.fail("prefill ran"))
    with pytest.raises((TypeError, ValueError), match=msg):
        eng.generate("x = ", 4, **kw)


def test_generate_shortcuts_equal_a_sampling_object():
    eng = baro_jax.load("tiny", progress=False)
    a = eng.generate("x = ", 12, temperature=0.8, top_p=0.9, seed=7).generated_ids
    b = eng.generate("x = ", 12, sampling=baro_jax.Sampling(temperature=0.8, top_p=0.9, seed=7)).generated_ids
    assert a == b
