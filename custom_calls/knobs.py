"""The kernel library's BARO_* knobs: one table, one strict reader.

The C++ code reads its knobs through csrc/common/knobs.h, on every call (the kernel tests switch
them between calls); this is the same table (tests/test_knobs.py checks the two agree, and that
no getenv in csrc reads a name outside it) with a line on what each knob does and which file
reads it. Five more are read in Python: BARO_CMDBUF_OPS (custom_calls/_lib.py),
BARO_MOE_SMALL_ROWS (custom_calls/moe.py), BARO_TOPK_ROWS (custom_calls/topk.py), BARO_GDN_PACK16
(custom_calls/matmul.py) and the loader's BARO_LIB_DIR. Every knob is a speed
or test switch: none changes the bits, except BARO_DELTA_BLOCKED_MMA (the blocked delta rule's
arithmetic on CUDA: its own bits, identical between prefill and decode under each setting).

Parsing is strict and matches knobs.h: an on/off knob takes 1/0, true/false, on/off, yes/no (any
case), a choice knob one of its words, an integer knob a decimal integer in its range; empty
counts as unset. Anything else is a `KnobError` (a ValueError) naming the variable and what it
allows. The wrappers check every C++ knob before a call (`check_all`), so a bad value is refused
in Python rather than by a handler inside a command buffer.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

ON = ("1", "true", "on", "yes")
OFF = ("0", "false", "off", "no")


class KnobError(ValueError):
    """A BARO_* kernel knob holds a value it cannot take."""


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # "onoff", "choice", "int", "path"
    default: object  # onoff: bool; choice: the word; int: the number (None: see default_text)
    doc: str  # what it does, and the file that reads it
    choices: tuple[str, ...] = ()
    lo: int | None = None
    hi: int | None = None
    reader: str = "C++"  # "C++": read through csrc/common/knobs.h; "Python": read by custom_calls
    default_text: str | None = None

    def values_text(self) -> str:
        if self.kind == "onoff":
            return "on / off"
        if self.kind == "choice":
            return " / ".join(self.choices)
        if self.kind == "int":
            return f"{self.lo}..{self.hi}"
        return "a directory"

    def allowed(self) -> str:
        if self.kind == "onoff":
            return f"on or off (one of {'/'.join(ON)} or {'/'.join(OFF)})"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "int":
            return f"an integer in [{self.lo}, {self.hi}]"
        return "a directory"

    def parse(self, text: str):
        """text as this knob's value (bool, str or int); KnobError when it is not allowed."""
        s = text
        if self.kind == "onoff":
            if s.lower() in ON:
                return True
            if s.lower() in OFF:
                return False
        elif self.kind == "choice":
            if s in self.choices:
                return s
        elif self.kind == "int":
            body = s[1:] if s[:1] in "+-" else s
            if body and body.isascii() and body.isdigit():
                v = int(s, 10)
                if self.lo <= v <= self.hi:
                    return v
        else:
            return s
        raise KnobError(f"{self.name} must be {self.allowed()}, got {text!r}")


def opt_in(name: str, doc: str) -> Knob:
    """A kernel instance that is off until measured: 0, 1 (where it can run), or require (tests: an
    error where it cannot, so a byte test cannot pass on the default)."""
    return Knob(name, "choice", "0", choices=("0", "1", "require"), doc=doc)


# Keep in step with csrc/common/knobs.h (tests/test_knobs.py).
_TABLE: tuple[Knob, ...] = (
    Knob("BARO_CPU_THREADS", "int", None, lo=1, hi=4096, default_text="the hardware threads",
         doc="worker threads of the CPU kernels; more than 4 x the hardware threads runs as 4 x, and a thread "
             "that cannot start leaves its rows to the calling thread (csrc/common/ffi_util.h)"),
    Knob("BARO_ATTN_DUP", "onoff", False,
         doc="on: the CUDA decode attention tile runs one copy of its warp pair instead of two "
             "(csrc/gpu/attention_fa.cuh)"),
    Knob("BARO_ATTN_WGMMA", "choice", "1", choices=("1", "0", "require"),
         doc="1: the sm_90a wgmma prefill attention where it runs (the same bits as the mma.sync kernel); "
             "0: the mma.sync prefill kernel everywhere; require: an error where it would fall back (tests) "
             "(csrc/gpu/attention_fa.cuh)"),
    Knob("BARO_ATTN_PIPE", "choice", "1", choices=("1", "0", "2"),
         doc="1: the sm_90a prefill attention (K/V by TMA) issues a KV block's S wgmma before the previous "
             "block's softmax, so the tensor cores run it beside the softmax; 0: each S issued and waited for in "
             "its own block; 2: as 1, and a block's P V also runs beside the next block's softmax, the split "
             "merge's accumulators in GPU scratch (64 rows x head_dim fp32 a tile); the same bits "
             "(csrc/gpu/attention_wgmma.cu)"),
    Knob("BARO_MOE_FOLD", "onoff", True,
         doc="off: the shared expert and its gate as GEMMs of their own instead of folded into the router and "
             "grouped GEMMs (one token; many rows on 16-row slots) (csrc/gpu/moe.cu)"),
    Knob("BARO_MOE_TAIL", "choice", "1", choices=("1", "0", "combine"),
         doc="the fold's route and combine inside the grouped GEMMs (1), as their own kernels (0), or only the "
             "combine inside (combine) (csrc/gpu/moe.cu)"),
    Knob("BARO_MOE_HOST", "choice", "staged", choices=("staged", "direct"),
         doc="baro_moe_host on CUDA: misses staged in the call's scratch, or read by the GEMMs from the host "
             "store (csrc/gpu/moe.cu)"),
    Knob("BARO_NORM_GENERIC", "onoff", False,
         doc="on: every norm width on the runtime-width kernel (csrc/gpu/norm.cu)"),
    Knob("BARO_NORM_ROW_BLOCK", "onoff", True,
         doc="off: few-row rmsnorm calls on the warp kernel instead of a block per row (csrc/gpu/norm.cu)"),
    Knob("BARO_DELTA_COLS", "choice", "32", choices=("32", "16"),
         doc="state columns per block of the CUDA delta rule (16: twice the blocks) (csrc/gpu/delta.cu)"),
    Knob("BARO_DELTA_ONE", "choice", "auto", choices=("auto", "cols", "heads", "pipe", "off"),
         doc="one-token delta calls: the one-token instance with a head's column blocks adjacent in the grid "
             "(cols) or the heads adjacent (heads), the pipelined persistent instance (pipe: the next tiles' "
             "state in flight while one computes), or the 32-token kernel (off); auto: pipe when the call has "
             "more state tiles than the GPU has SMs (many sequences), cols otherwise (csrc/gpu/delta.cu)"),
    Knob("BARO_DELTA_KV", "choice", "butterfly", choices=("butterfly", "gather", "two"),
         doc="many-token delta calls on CUDA: a token's kv partials summed over a state column's lanes by the "
             "xor butterfly (three dependent shuffles), or to the same value by seven independent shuffles and "
             "the butterfly's tree (gather) or by the butterfly's first level then three shuffles (two) "
             "(csrc/gpu/delta.cu)"),
    Knob("BARO_DELTA_STAGE", "choice", "fixed", choices=("fixed", "index"),
         doc="many-token delta calls on CUDA: a 32-token batch's per-batch work in few instructions (fixed: a "
             "fixed chunk per thread stepped token by token, one lane per q/k row's scale; -18% on the op on an "
             "H100) or as first written (index: one flat copy index divided per copy, every lane forming each "
             "row's scale); the same copies and values (csrc/gpu/delta.cu)"),
    Knob("BARO_DELTA_BLOCKED_MMA", "onoff", False,
         doc="on: the blocked delta rule (delta_rule blocked) on CUDA with its products on the tensor cores "
             "(mma.sync m16n8k8, 3xTF32) instead of the CUDA-core fmaf chains: its own bits, so keep one "
             "setting from a run's first token (prefill and decode agree under either); HIP ignores it "
             "(csrc/gpu/delta_blocked.cu)"),
    Knob("BARO_GEMM_TILE", "choice", "auto", choices=("auto", "16", "simple", "64", "128"),
         doc="forces the GEMM tile config of every call of more than one row (csrc/gpu/matmul.cu)"),
    Knob("BARO_GEMM_SMALL", "choice", "auto", choices=("auto", "stream", "rows16", "simple"),
         doc="the kernel of 16-row slots (GEMMs of 2 to 16 rows, narrow ones of up to 64, grouped MoE calls of "
             "few rows per expert): stream (gemm_row1's stream over 16-row slots), rows16 (gemm_rows16), "
             "simple (the simple synchronous GEMM, one-row calls too); auto: the stream for a plain GEMM of "
             "2 to 16 rows, rows16 otherwise (csrc/gpu/matmul.cu)"),
    Knob("BARO_GEMM_ROW1", "onoff", True,
         doc="off: one-row GEMMs on gemm_rows16 instead of the streaming gemm_row1 (csrc/gpu/matmul.cu)"),
    Knob("BARO_GEMM_WGMMA", "choice", "1", choices=("1", "0", "require"),
         doc="1: plain GEMMs of 64 rows or more on the sm_90a wgmma + TMA kernel where it runs (the same bits as "
             "the mma.sync kernels); 0: the mma.sync kernels everywhere; require: an error where it would fall "
             "back (tests) (csrc/gpu/matmul.cu, csrc/gpu/gemm_wgmma.cu)"),
    Knob("BARO_GEMM_WGMMA_GROUPED", "choice", "auto", choices=("auto", "0", "down", "sorted"),
         doc="sorted: the MoE's grouped GEMMs of prefill (tiles of 64 or 128 rows) on the wgmma kernel too, where "
             "BARO_GEMM_WGMMA lets it run: the down GEMM (A read in place) and the gate/up GEMM with the fused "
             "SwiGLU, its A rows copied into sorted order first and read by TMA; down: the down GEMM only; 0: "
             "neither; auto: sorted for calls of at least 32,768 pairs (4,096 tokens of top 8), where it was "
             "measured faster; the same bits (csrc/gpu/matmul.cu, csrc/gpu/moe.cu, csrc/gpu/gemm_wgmma.cu)"),
    Knob("BARO_GEMM_WGMMA_RING", "choice", "4", choices=("4", "3"),
         doc="the wgmma GEMM's TMA ring: 4 stages (one 128-row block per SM) or 3 (two blocks per SM, so one "
             "block's ring start and stores overlap the other's wgmmas); the same bits (csrc/gpu/gemm_wgmma.cu)"),
    Knob("BARO_GEMM_WGMMA_BN", "choice", "auto", choices=("auto", "128", "256", "grouped", "plain"),
         doc="the wgmma GEMM's W tile: 128 rows, or 256 (a third less read from L2 per product, one block per "
             "SM) for every call wider than 128 output columns (256), the MoE's grouped calls only (grouped) or "
             "the plain ones only (plain); auto: 256 for calls of at least 4,096 rows or 32,768 pairs, where it "
             "was measured faster (a prefill chunk of 4,096 or 8,192; decode steps keep 128); the same bits "
             "(csrc/gpu/gemm_wgmma.cu)"),
    Knob("BARO_GEMM_WGMMA_PERSIST", "choice", "0", choices=("0", "1", "3"),
         doc="1: the wgmma GEMM's grid as many blocks as are resident on the SMs at once, each walking every "
             "gridDim-th output tile with one ring (the next tile's stages land while the last one's are stored); "
             "3: three blocks (tests: many tiles a block at any shape); 0: a block per tile; the same bits "
             "(csrc/gpu/gemm_wgmma.cu)"),
    Knob("BARO_ROWS16_RING", "choice", "auto", choices=("auto", "deep", "light"),
         doc="gemm_rows16's cp.async ring: deep (8 stages, SwiGLU 6: one or two blocks per SM) or light (4, "
             "SwiGLU 3: twice the blocks per SM); auto: light for grouped MoE calls and grids of 4 blocks per SM, "
             "deep otherwise "
             "(csrc/gpu/matmul.cu)"),
    Knob("BARO_ROWS16_WARPS", "choice", "auto", choices=("auto", "4", "2", "1"),
         doc="gemm_rows16's warps per block (8 output columns each); auto: 4, or 1 for a SwiGLU GEMM whose "
             "four-warp blocks would leave half the SMs idle (csrc/gpu/matmul.cu)"),
    Knob("BARO_ROWS16_TALL", "choice", "off", choices=("off", "on"),
         doc="on: gemm_rows16's slots of a plain GEMM of more than 16 rows hold 32 or 64 rows (one W read per "
             "column block; slower at 64 sequences on the H200) instead of 16 (csrc/gpu/matmul.cu)"),
    opt_in("BARO_ROWS16_PERSIST",
           doc="1: a grouped gemm_rows16 call (the MoE's expert GEMMs of a decode step of many sequences) on a "
               "persistent grid of SMs x resident blocks that deal the (tile, column block) items round-robin, "
               "split the last partial round into column pieces over all the blocks and stream each block's "
               "items through one ring (the same bits; opt-in until measured on a GPU); require: an error where "
               "a grouped gemm_rows16 call cannot take it (tests) (csrc/gpu/matmul.cu, csrc/gpu/gemm_rows16.cuh)"),
    Knob("BARO_PIPE_RING", "choice", "auto", choices=("auto", "deep", "shallow"),
         doc="the pipelined 64/128-row GEMM's cp.async ring: shallow (3 stages: two or three blocks per SM) or "
             "deep (8 stages at 64-row tiles, 6 at 128: one block per SM); auto: deep when the grid has no more blocks than "
             "SMs (a decode step's projections), shallow otherwise (csrc/gpu/matmul.cu)"),
    Knob("BARO_PIPE_ORDER", "choice", "auto", choices=("auto", "rows", "cols"),
         doc="the tiled GEMM kernels' grid order: rows (a column tile's row slots side by side) or cols (a row "
             "slot's column tiles side by side: its A rows and an expert's weight panels read from DRAM once "
             "while they run); auto: cols for the MoE's grouped GEMMs (prefill: the pipelined kernel and the "
             "wgmma one), rows otherwise; speed only (csrc/gpu/matmul.cu, gemm_wgmma.cu)"),
    Knob("BARO_PDL", "onoff", False,
         doc="on: a handler's later kernels as programmatic dependent launches on sm_90 (csrc/gpu/matmul.cu)"),
    Knob("BARO_ROW1_BPS", "int", 3, lo=1, hi=8,
         doc="gemm_row1 blocks per SM (csrc/gpu/matmul.cu)"),
    Knob("BARO_ROW1_KCHUNK", "int", 2048, lo=128, hi=4096,
         doc="gemm_row1's largest k piece, rounded down to a multiple of 128 (csrc/gpu/matmul.cu)"),
    Knob("BARO_ROW1_STAGES", "int", 2, lo=2, hi=16,
         doc="gemm_row1's fewest ring stages (csrc/gpu/matmul.cu)"),
    Knob("BARO_ROW1_NT", "int", 0, lo=0, hi=4,
         doc="gemm_row1 n-tiles per unit (0: by the number of units) (csrc/gpu/matmul.cu)"),
    Knob("BARO_ROW1_COPY", "choice", "bulk", choices=("bulk", "lsu"),
         doc="gemm_row1's ring fill: the copy engine's bulk copies or 16-byte cp.async per lane "
             "(csrc/gpu/matmul.cu)"),
    opt_in("BARO_ROW1_ASHARED",
           doc="1: a plain GEMM of 2 to 16 rows on the stream's blocks of up to BARO_ROW1_BPS warps (one per "
               "SM) that load the rows' A once and share it, each warp streaming its own W, where A fits beside "
               "the rings (the same bits; opt-in until measured on a GPU); require: an error where a call on the "
               "16-row stream cannot take it (tests) (csrc/gpu/matmul.cu, csrc/gpu/gemm_row1.cuh)"),
    opt_in("BARO_ROW1_TMA",
           doc="1: plain GEMMs of 1 to 16 rows without SwiGLU on the stream's TMA instance, each 128-wide k piece "
               "filled by two tensor copies issued by one lane instead of one bulk copy per row (the same bits; "
               "opt-in until measured on a GPU); require: an error where such a call cannot take it (tests) "
               "(csrc/gpu/matmul.cu, csrc/gpu/gemm_row1.cuh)"),
    opt_in("BARO_ROW1_SWAP",
           doc="1: the GEMMs on gemm_row1's stream (1 to 16 rows a slot; not the one-token MoE's fused route and "
               "combine) on its instance that gives W the mma's 16-row operand and the rows its 8-wide one (the same "
               "bits; slower on an H100: half the accumulator chains); require: an error where a call on the stream "
               "cannot take it (tests) (csrc/gpu/matmul.cu, csrc/gpu/gemm_row1.cuh)"),
    opt_in("BARO_MOE_ROUTE_GROUP",
           doc="1: the MoE's top-k of every row and the grouping of its pairs in one block where they are one "
               "chunk (up to 512 pairs: decode of up to 64 sequences), one launch a layer fewer (the same bits; "
               "the same time as the two kernels on an H100); require: an error where the pairs are more than one "
               "chunk (tests) "
               "(csrc/gpu/moe.cu)"),
    Knob("BARO_MOE_PAIRS16", "onoff", True,
         doc="off: the MoE's grouped down GEMM on wgmma (prefill chunks) stores its pair rows as fp32 instead "
             "of bf16 (the same bits: the combine rounds every pair row to bf16 first) (csrc/gpu/moe.cu)"),
    Knob("BARO_MOE_COMBINE_WIDE", "onoff", True,
         doc="off: the MoE combine over bf16 pair rows (BARO_MOE_PAIRS16) takes 4 columns a thread instead of 8 "
             "with 16-byte loads and stores (the same bits; the MoE op -2.4% / -2.8% at 4,096 / 8,192 rows on an "
             "H100, 9e8d30a) (csrc/gpu/moe.cu)"),
    Knob("BARO_CMDBUF_OPS", "onoff", True, reader="Python",
         doc="off: calls of <= 16 rows on the ops that take scratch from XLA's allocator instead of the _small "
             "twins that may run inside command buffers (custom_calls/_lib.py)"),
    Knob("BARO_MOE_SMALL_ROWS", "int", 64, lo=1, hi=256, reader="Python",
         doc="the most rows of a baro_moe / baro_moe_slots call that runs on its _small twin (its GPU scratch "
             "a result, so it may run inside command buffers; a decode step of more sequences than this is "
             "several graphs) (custom_calls/moe.py)"),
    Knob("BARO_TOPK_ROWS", "choice", "all", choices=("all", "cpu", "off"), reader="Python",
         doc="the top_k of sampling inside the decode graph: all: baro_topk_rows (a radix select per row, the "
             "same bytes as lax.top_k) wherever its kernel is built (GPUs: k <= 256; +5.8% at B = 64 and +1.4% at "
             "B = 8 on the H200 with top_k 20); cpu: on the CPU only, lax.top_k on GPUs; off: lax.top_k "
             "everywhere (custom_calls/topk.py)"),
    Knob("BARO_GDN_PACK16", "choice", "auto", choices=("auto", "all", "off"), reader="Python",
         doc="the GDN input projection's conv channels as bf16 packed at the start of each row of its f32 "
             "output, read so by the conv (half the bytes written and read; the same bits: the conv rounds them "
             "to bf16 on load otherwise): auto: calls of at least 64 rows (prefill chunks, the wgmma GEMM's "
             "calls; +1.0% / +0.8% at 8k / 32k on an H100, 9e8d30a); all: every call (tests); off: fp32 "
             "(custom_calls/matmul.py)"),
    Knob("BARO_LIB_DIR", "path", None, reader="Python", default_text="unset",
         doc="a directory searched first for libbaro_cpu.so / libbaro_cuda.so / libbaro_hip.so "
             "(custom_calls/_lib.py)"),
)
# name -> Knob, in the table's order (iterating gives the names)
KNOBS: Mapping[str, Knob] = {k.name: k for k in _TABLE}
BY_NAME = KNOBS
CPP_KNOBS = tuple(k.name for k in _TABLE if k.reader == "C++")


def knob(name: str, env: Mapping[str, str] | None = None):
    """The knob's value now: its parse, or its default when unset or empty. KnobError when the
    variable holds a value the knob does not allow."""
    k = BY_NAME[name]
    s = (os.environ if env is None else env).get(name)
    if s is None or s == "":
        return k.default
    return k.parse(s)


def check_all(env: Mapping[str, str] | None = None) -> None:
    """Raises KnobError for the first C++ knob whose value knobs.h would refuse."""
    env = os.environ if env is None else env
    for name in CPP_KNOBS:
        knob(name, env)


def _default_text(k: Knob) -> str:
    if k.default_text is not None:
        return k.default_text
    if isinstance(k.default, bool):
        return "on" if k.default else "off"
    return str(k.default)


def knobs_table() -> str:
    """The Markdown table of every kernel knob, as the README shows it."""
    rows = ["| knob | values | default | what it does |", "|---|---|---|---|"]
    for k in KNOBS.values():
        rows.append(f"| `{k.name}` | {k.values_text()} | {_default_text(k)} | {k.doc} |")
    return "\n".join(rows)
