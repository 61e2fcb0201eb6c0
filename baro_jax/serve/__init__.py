"""An OpenAI-compatible HTTP server over the many-sequence engine (docs/DESIGN.md §11).

    python -m baro_jax.serve --model tiny --port 8000

or in-process: baro_jax.serve.server.Server(baro_jax.load("tiny")).start() returns the URL. The
pieces: loop.py (the thread that owns the device and steps the pool), protocol.py (requests read
and checked), render.py (responses in OpenAI's shapes), app.py (the Starlette routes), server.py
(uvicorn and the loop started and stopped together). Needs the `serve` extra (starlette,
uvicorn); nothing is imported here, so the command line can say so plainly when they are missing.
"""
