"""Expert parallel (baro_jax/expert_parallel.py, issue 14): load(devices=N) on N forced host
devices gives the bytes of one device, batched and replay, states, logits and greedy tokens; the
MoE lowers to the per-pair kernels with one all-gather of bf16 pair outputs and no reduction.
Each N runs in a child process because XLA_FLAGS must be set before jax initialises."""
import json
import os
import subprocess
import sys

import pytest

CHILD = os.path.join(os.path.dirname(__file__), "ep_child.py")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_n_devices_bytes_equal_one(n):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("BARO_EP_PAIRS", None)  # the child checks the default path at N = 1 and forces the pairs one itself
    r = subprocess.run([sys.executable, CHILD, str(n), "tiny", "tiny-random"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("OK ") == (14 if n == 1 else 8), r.stdout  # n = 1: also the per-pair kernels forced


def test_devices_argument_errors():
    import baro_jax

    with pytest.raises(ValueError, match=r"devices \(--devices\) 5: this host has 1"):
        baro_jax.load("tiny-random", backend="ordered", progress=False, devices=5)
    with pytest.raises(ValueError, match=r"devices \(--devices\)"):
        baro_jax.load("tiny-random", backend="ordered", progress=False, devices=0)
    with pytest.raises(TypeError, match=r"devices \(--devices\)"):
        baro_jax.load("tiny-random", backend="ordered", progress=False, devices=1.0)
    with pytest.raises(ValueError, match="resident mode"):
        baro_jax.load("tiny-random", backend="ordered", progress=False, devices=1, mode="tier")
    with pytest.raises(ValueError, match="ordered kernels"):
        baro_jax.load("tiny-random", backend="xla", progress=False, devices=1)


def test_budget_counts_a_device_share_of_the_experts():
    import jax.numpy as jnp
    from baro_jax import budget
    from baro_jax.config import preset

    small = preset("tiny-random")
    one = budget.check_resident(small, jnp.bfloat16, None)
    two = budget.check_resident(small, jnp.bfloat16, None, devices=2)
    experts = small.num_layers * budget.expert_layer_bytes(small, jnp.bfloat16)
    assert one - two == experts // 2
    big = preset("qwen3-next-80b-a3b")  # 148 GiB of weights: 2 devices hold about 74 each
    with pytest.raises(MemoryError, match="per device over 2 devices"):
        budget.check_resident(big, jnp.bfloat16, 24.0, devices=2)


def test_speed_bench_runs_the_expert_parallel_path(tmp_path, capsys):
    """speed.py --devices N times the sharded engine (issue 14's speed row) and checks its identity;
    the xla arm is refused with a message (expert parallel runs the ordered kernels)."""
    from benchmarks import speed

    out = tmp_path / "s.json"
    rc = speed.main(["--model", "tiny", "--arms", "batch-ordered", "--devices", "1", "--lengths", "40",
                     "--chunk", "16", "--decode-tokens", "4", "--check-tail", "8", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["summary"]["devices"] == 1 and res["summary"]["checks_pass"]
    with pytest.raises(SystemExit):
        speed.main(["--model", "tiny", "--arms", "batch-ordered,batch-xla", "--devices", "1", "--lengths", "40"])
    assert "--devices runs the ordered arms" in capsys.readouterr().err
