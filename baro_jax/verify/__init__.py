"""Verification as library code: the identity gate (batched prefill == replay, in bytes), its
many-sequence axis (each sequence of generate_batch == the sequence alone, batch_identity), the
teacher-forced agreement harness for order-changing variants, the long-context identity run,
and what their reports record. benchmarks/identity.py, batch_identity.py, agreement.py and
identity_longctx.py are their command lines.

    import baro_jax
    from baro_jax import verify

    eng = baro_jax.load("tiny")
    prompts = verify.load_prompts("benchmarks/prompts/identity.jsonl", eng.tokenizer)
    report = verify.run_identity_gate(eng, prompts, [16, 37, 64], new_tokens=16)
    assert report.ok, [r for r in report.rows if not verify.identity.row_ok(r)]
"""
from . import agreement, batch_identity, digests, identity, longctx
from .agreement import BAR, Agreement, run_agreement
from .batch_identity import BatchIdentityReport, run_batch_identity
from .digests import arm_digest, first_diff, host_leaves, same_bytes, state_names
from .identity import GateReport, read_reference, run_identity_gate
from .prompts import load_prompts, select
from .records import provenance, write_json

__all__ = ["BAR", "Agreement", "BatchIdentityReport", "GateReport", "agreement", "arm_digest", "batch_identity",
           "digests", "first_diff", "host_leaves", "identity", "load_prompts", "longctx", "provenance",
           "read_reference", "run_agreement", "run_batch_identity", "run_identity_gate", "same_bytes", "select",
           "state_names", "write_json"]
