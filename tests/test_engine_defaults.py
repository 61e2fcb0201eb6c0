"""The default prefill chunk: one chunk for short prompts, little padding for long ones."""
from baro_jax.settings import DEFAULT_CHUNK
from baro_jax.shapes import MAX_PAD_FRACTION, default_chunk


def test_short_prompts_run_as_one_power_of_two_chunk():
    for n in (1, 5, 17, 300, 1024, 5000, DEFAULT_CHUNK):
        c = default_chunk(n)
        assert c >= n and c & (c - 1) == 0 and (c // 2 < n or c == 16), (n, c)


def test_long_prompts_bound_the_padding():
    for n in (DEFAULT_CHUNK + 1, 9000, 12000, 32768, 100_000, 131_072):
        c = default_chunk(n)
        rows = -(-n // c) * c
        assert c <= DEFAULT_CHUNK and c & (c - 1) == 0, (n, c)
        assert rows <= (1 + MAX_PAD_FRACTION) * n, (n, c, rows)
    assert default_chunk(32768) == DEFAULT_CHUNK
    assert default_chunk(9000) == 2048  # 5 x 2048 = 10240 rows, not 2 x 8192 = 16384
