"""Expert-sharded weights (baro_jax/expert_parallel.py, issue 14 CPU step): N forced host devices
give the bytes of one device, batched and replay, states and logits. Each N runs in a child
process because XLA_FLAGS must be set before jax initialises."""
import os
import subprocess
import sys

import pytest

CHILD = os.path.join(os.path.dirname(__file__), "ep_child.py")


@pytest.mark.parametrize("n", [2, 4])
def test_n_devices_bytes_equal_one(n):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, CHILD, str(n), "tiny", "tiny-random"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("OK ") == 6, r.stdout
