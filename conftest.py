"""Repository-wide pytest fixtures.

Being in the repository root, this file also makes pytest put the root on sys.path (its
rootdir conftest rule), so tests import the benchmark scripts as `benchmarks.<script>`, the way
they import any module, without editing sys.path themselves.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def bench_script():
    """run(name, *args, timeout=600): `python benchmarks/<name>.py args` as its command line runs
    in benchmarks/run_gpu.sh, from the repository root; returns the CompletedProcess (text)."""
    def run(name, *args, timeout=600):
        return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), *map(str, args)],
                              capture_output=True, text=True, cwd=ROOT, timeout=timeout)

    return run
