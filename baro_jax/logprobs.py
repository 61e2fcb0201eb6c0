"""Log-probabilities: log_softmax rows in an order that does not depend on the row count.

XLA's own log_softmax is a reduction whose order may change with the number of rows (on GPU it
does), so a logprob read from a batch of 64 could differ from the same sequence's alone. The
ordered backend runs it as a custom call with a fixed order per row; elsewhere each row runs as
one [V]-shaped computation (lax.map), which compiles to the same code for any row count.
"""
from __future__ import annotations

import jax


def row_logprobs(ops, logits):
    """log_softmax of each row of logits [m, V] fp32."""
    if hasattr(ops, "log_softmax"):
        return ops.log_softmax(logits)
    return _ROWS(logits)


_ROWS = jax.jit(lambda x: jax.lax.map(jax.nn.log_softmax, x))
