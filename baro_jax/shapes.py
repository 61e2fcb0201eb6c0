"""The shapes a request compiles to: its prefill chunk and its KV length.

Both are powers of two picked from the request's size, so a few graphs serve every
request. Neither changes the bits (the kernels are row-invariant), only the time and
the memory.
"""
from __future__ import annotations

from .settings import DEFAULT_CHUNK

MAX_PAD_FRACTION = 0.25  # padding rows a long prompt may waste in its last chunk
MIN_CHUNK = 16
MIN_STATE_LEN = 1024


def default_chunk(n_prompt: int) -> int:
    """The prefill chunk a request uses unless told otherwise.

    A prompt of at most DEFAULT_CHUNK tokens runs as one chunk, the smallest power of two
    >= its length (at least MIN_CHUNK). A longer one takes the largest power of two <=
    DEFAULT_CHUNK whose padded last chunk keeps the rows computed within MAX_PAD_FRACTION of
    the prompt (9000 tokens: 5 x 2048, not 2 x 8192).
    """
    c = MIN_CHUNK
    while c < n_prompt and c < DEFAULT_CHUNK:
        c *= 2
    if n_prompt <= c:
        return c
    while c > MIN_CHUNK and -(-n_prompt // c) * c > (1 + MAX_PAD_FRACTION) * n_prompt:
        c //= 2
    return c


def state_length(n: int, max_context: int) -> int:
    """KV length for a request of n tokens: a power of two >= n (at least MIN_STATE_LEN), at
    most max_context."""
    L = MIN_STATE_LEN
    while L < n:
        L *= 2
    return min(L, max_context)
