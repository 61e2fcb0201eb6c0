"""One persistent XLA compilation cache for a test run: its xdist workers and the command-line
runs the tests start share it, so a graph compiled by one (the tiny model's prefill and decode
graphs, compiled by dozens of tests in separate processes) is read back by the others. A cached
executable is the one a fresh compile would give, so no test's bytes change; the cache starts
empty each run and is removed when the run ends. BARO_TEST_JAX_CACHE=off turns it off."""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid

# set by the process pytest starts in, before it starts its xdist workers, which inherit it (as
# does a pytest that a test starts: it must not remove the cache, so only the first one owns it)
OWNER = "BARO_TEST_RUN" not in os.environ
_RUN = os.environ.setdefault("BARO_TEST_RUN", uuid.uuid4().hex[:12])
CACHE_DIR = os.path.join(tempfile.gettempdir(), f"baro_jax_test_xla_cache_{_RUN}")
ENABLED = os.environ.get("BARO_TEST_JAX_CACHE", "on") != "off"

if ENABLED:
    # environment variables, so that the subprocesses the tests start read them too
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    import jax  # noqa: E402  (after the variables: a jax imported before them reads them here)

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
    # the process that made the run's cache removes it (not its workers, nor a pytest a test started)
    if ENABLED and OWNER and os.environ.get("JAX_COMPILATION_CACHE_DIR") == CACHE_DIR:
        shutil.rmtree(CACHE_DIR, ignore_errors=True)
