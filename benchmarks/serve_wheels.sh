#!/usr/bin/env bash
# The server's Python packages as wheels for the GPU machine, which has no network: run here
# (where pip reaches the registry) before a device call that runs `run_gpu.sh serve`, and carry
# .whl (git-ignored); stage_serve installs them (install_whl) into /tmp/site.
# Pure-Python wheels for Python 3.12: starlette and uvicorn, what they need beyond the machine's
# image (h11, anyio, sniffio, click), and httpx for serve_bench.py's clients.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
for pkg in "starlette>=0.37" "uvicorn>=0.29" h11 anyio sniffio click httpx httpcore idna certifi typing_extensions; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    --platform any -d .whl "$pkg"
done
ls .whl
