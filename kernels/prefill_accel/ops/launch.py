"""Launch policy of the kernels: tile shapes and autotuning, the K/V read mode, when split-KV and
the exact estimate's key split pay, the search's launch shape, and the environment switches.
Decided here from the inputs' shapes and the GPU; the kernels take what these return."""

from __future__ import annotations

import os

import torch
import triton

from ..layout import BatchLayout
from .common import INTERPRET, TENSOR_DESCRIPTORS, TMA_NEEDS_TRITON, TRITON_VERSION, warn_once

# Split-KV by kept blocks (see split_slots): a row's walk is cut into ranges of at least
# MIN_SPLIT_BLOCKS key blocks (2K keys at block 128, enough to pay for its share of the merge), at
# most MAX_SPLITS of them. SPLIT_BALANCE: a range is 1/SPLIT_BALANCE of the launch's work per program
# slot, PROGRAMS_PER_SM slots per multiprocessor (two of the default 128 x 64 tiles fit).
# SPLIT_OVER_RANGES: a row splits only when its walk exceeds this many ranges (1.5 slots' fair share):
# the ranges' launch runs before the rest with the GPU mostly idle for about one range, so a row only
# a little longer than a slot's share loses that and gains less (docs/benchmarks.md, Split-KV by
# kept blocks: by the GPU's own time, 9% slower split at about one share, 1.2-3.2x faster from 2.4).
MIN_SPLIT_BLOCKS = 16
MAX_SPLITS = 16
SPLIT_BALANCE = 2
SPLIT_OVER_RANGES = 3
PROGRAMS_PER_SM = 2
MERGE_BLOCK_M = 64  # query rows per program of the merge; divides every supported block size
# PREFILL_ACCEL_SPLIT_KV=0 leaves every row of a sparse launch to one program (to compare).
SPLIT_KV = os.environ.get("PREFILL_ACCEL_SPLIT_KV", "1") != "0"
EXACT_TILE_ROWS = 128  # sampled rows (x query heads of a group) sharing one key walk of the exact estimate
EXACT_WAVES = 2  # see exact_splits
MIN_EXACT_SPLIT_BLOCKS = 8  # 1K keys at block 128: enough walk per range to pay for its share of the merge


# Tile shapes (BLOCK_M, BLOCK_N, warps, stages) of the attention kernel. Rows gathered through the
# page table (pointer reads) and rows brought by bulk tensor copies (TMA) favour different shapes: with
# TMA one warpgroup per 128 query rows was best at head_dim 128 (docs/benchmarks.md, Reading K/V with TMA).
POINTER_TILES = [
    (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 2), (64, 32, 4, 2),
    (128, 128, 4, 2),  # the best at head_dim 64 (docs/benchmarks.md, SmolLM2's shape)
    (64, 128, 4, 3),
]  # fmt: skip
TMA_TILES = [(128, 64, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 4, 2), (64, 32, 4, 2)]
# Head sizes read with TMA by default: at head_dim 128 bulk copies beat per-row reads in the dense mode
# and, from 32K, in the sparse path; at head_dim 64 they lost in the sparse path; 256 was checked for
# correctness only (docs/benchmarks.md, Reading K/V with TMA).
TMA_HEAD_DIMS = (128,)
# Below this context a sparse launch reads through the page table: the staging copy and the short walks
# cost more than bulk copies save there (docs/benchmarks.md, Reading K/V with TMA).
TMA_SPARSE_MIN_KEYS = 32768
INTERPRET_TILE = (64, 64, 4, 1)  # the interpreter gets the one with fewest programs
STAGE_BYTES = 256 * 2**20  # the most K+V one launch stages for TMA reads (see stage_kv)
# PREFILL_ACCEL_KV_READS=pointer keeps every K/V read on the page-table gather, even where TMA works.
KV_READS = os.environ.get("PREFILL_ACCEL_KV_READS", "auto")
# PREFILL_ACCEL_AUTOTUNE=0 takes the first fitting tile shape of the list without timing any (quick first calls).
AUTOTUNE = os.environ.get("PREFILL_ACCEL_AUTOTUNE", "1") != "0"


def set_descriptor_blocks(nargs) -> None:
    """Autotuning pre-hook: the TMA descriptors bring BLOCK_N rows of one head per copy."""
    for name in ("k_desc", "v_desc"):
        if nargs[name] is not None:
            nargs[name].block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]


def attention_configs() -> list[triton.Config]:
    """Tile shapes tried for the attention kernel: both lists, pruned to the launch's read mode."""
    shapes = [INTERPRET_TILE] if INTERPRET else list(dict.fromkeys(POINTER_TILES + TMA_TILES))
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=set_descriptor_blocks)
        for bm, bn, w, s in shapes
    ]


def prune_attention_configs(configs, named_args, **kwargs):
    """Keep the tiles of the launch's read mode that divide the block (and, with TMA, the page)
    and fit in shared memory for large heads."""
    block, head_dim, tma = kwargs["BLOCK"], kwargs["HEAD_DIM"], kwargs["TMA"]
    mode_tiles = set(TMA_TILES if tma else POINTER_TILES) | {INTERPRET_TILE}
    kept = [
        c
        for c in configs
        if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in mode_tiles
        and block % c.kwargs["BLOCK_M"] == 0
        and block % c.kwargs["BLOCK_N"] == 0
        and (not tma or kwargs["PAGE_SIZE"] % c.kwargs["BLOCK_N"] == 0)
        and (head_dim < 256 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64)
    ]
    if kept and not AUTOTUNE:
        return kept[:1]
    return kept or [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=1, pre_hook=set_descriptor_blocks)]


SIZE_CLASS_BOUNDS = (2048, 8192)
"""Query blocks x heads of an attention launch where its autotuning class changes (see size_class)."""


def size_class(programs: int) -> int:
    """Autotuning bucket of a launch by its query blocks x heads (SIZE_CLASS_BOUNDS): the best tile
    shape for a few hundred programs is not the best for many waves of them, so each class tunes once."""
    return sum(programs >= bound for bound in SIZE_CLASS_BOUNDS)


def tma_capable(device: torch.device) -> bool:
    """Whether K/V tiles can come by bulk tensor copies on ``device``: a CUDA GPU of compute capability 9.0
    or later, under a Triton with tensor descriptors."""
    return TENSOR_DESCRIPTORS and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def kv_read_mode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sparse_context: int = 0) -> str:
    """"tma" for 16-bit caches at a head size in TMA_HEAD_DIMS on CUDA GPUs with bulk tensor copies
    (compute capability 9.0 and later) under a Triton that has tensor descriptors (3.4 and later), in
    dense mode or for a sparse launch whose longest sequence (``sparse_context``; 0 in dense mode) has
    TMA_SPARSE_MIN_KEYS keys; else "pointer". PREFILL_ACCEL_KV_READS=pointer (or tma) decides instead;
    tma where the GPU or Triton lacks it reads through the page table, with one warning."""
    if KV_READS == "tma" and not TENSOR_DESCRIPTORS:
        warn_once(f"PREFILL_ACCEL_KV_READS=tma needs Triton >= {TMA_NEEDS_TRITON} (tensor descriptors), this is "
                  f"{triton.__version__}: reading K/V through the page table")  # fmt: skip
        return "pointer"
    capable = tma_capable(q.device)
    if KV_READS == "tma" and not (capable or INTERPRET):
        warn_once("PREFILL_ACCEL_KV_READS=tma needs compute capability 9.0 or later: reading K/V through the page table")
        return "pointer"
    if KV_READS in ("pointer", "tma"):
        return KV_READS
    sixteen_bit = k_cache.dtype in (torch.float16, torch.bfloat16) and v_cache.dtype == k_cache.dtype
    long_enough = sparse_context == 0 or sparse_context >= TMA_SPARSE_MIN_KEYS
    return "tma" if capable and sixteen_bit and q.shape[2] in TMA_HEAD_DIMS and long_enough else "pointer"


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def plans_splits(programs: int) -> bool:
    """Whether a sparse launch of ``programs`` (query blocks x query heads) gets a split plan: one of
    the smallest autotuning class (size_class 0: a chunk of up to 16K queries at 12 heads, under eight
    waves on an H200), unless PREFILL_ACCEL_SPLIT_KV=0. Larger launches, a whole long prompt in one
    call, have rows enough of every length to balance themselves, and the plan's launches only cost
    them time (docs/benchmarks.md, Split-KV by kept blocks); one class either way keeps what the
    engine's warm-up compiles (engine.warmup) what serving launches."""
    return SPLIT_KV and size_class(programs) == 0


def split_slots(group: int, sms: int) -> tuple[int, int]:
    """Program slots the split plan spreads a sparse launch over on ``sms`` multiprocessors
    (SPLIT_BALANCE per program that runs at once, so a range is half a program's fair share of the
    work), and the scratch slots it may fill with partial results (one query block of a KV group's
    heads each). A row splits only when its walk exceeds SPLIT_OVER_RANGES (at least two) ranges, so
    the split rows hold at most their walks over a range plus one slot each, together under ``2 * slots / group``
    (docs/kernels.md, Split-KV by kept blocks)."""
    slots = SPLIT_BALANCE * PROGRAMS_PER_SM * sms
    return slots, -(-2 * slots // group) + MAX_SPLITS


def exact_splits(layout: BatchLayout, programs: int, sms: int) -> int:
    """Key ranges each (tile, KV head) of the exact estimate is split into: enough programs for
    EXACT_WAVES waves on ``sms`` multiprocessors, each range at least MIN_EXACT_SPLIT_BLOCKS key
    blocks. A fresh long prompt has tiles enough; a chunk after a long prefix has few tiles, each
    walking the whole context, and needs the split."""
    longest = max(layout.max_k_blocks, 1)
    wanted = -(-EXACT_WAVES * sms // max(programs, 1))
    return max(1, min(wanted, longest // MIN_EXACT_SPLIT_BLOCKS))


def search_launch(head_dim: int, scored_rows: int, means: bool, bounds: bool) -> tuple[int, dict]:
    """Rows the selection kernel scores per chunk (``scored_rows``: the scored rows of a query block
    times the query heads of its group), and its key tile and launch options (BLOCK_J, num_warps,
    num_stages), for the pooled estimate (``means``), the bound one (``bounds``) or both.

    As timed (docs/benchmarks.md, The three searches, and the search's launch): 4 warps up to
    head_dim 128, key tiles of 32 blocks for the bound search; at head_dim 256, 8 warps and tiles of
    32. Searches with more than 256 operand values per key block run unpipelined (with fp32 operands,
    the pipelined bound search at head_dim 256 asked for 288 KB of shared memory), and bound searches
    at head_dim 256 take half the rows. At least 16 rows: the smallest tile tl.dot multiplies (the
    padding rows are masked). Triton before 3.4 keeps the bound search at head_dim 256 on 4 warps: with 8,
    Triton 3.0's compiler aborts on it (an MMA layout conversion it has for Ampere only;
    scripts/compile_check.py); and it scores at most 64 rows per chunk in the mixed search up to head_dim
    64: with 128, Triton 3.0's code on the H200 fails the check against the float32 reference, pipelined
    or not, and with 64 it passes (docs/vllm-0.6.md, Triton)."""
    row_chunk = max(16, min(64 if bounds and head_dim > 128 else 128, triton.next_power_of_2(scored_rows)))
    if means and bounds and head_dim <= 64 and TRITON_VERSION < (3, 4):
        row_chunk = min(row_chunk, 64)
    options = dict(BLOCK_J=64, num_warps=4)
    if head_dim > 128 or (bounds and not means):
        options["BLOCK_J"] = 32
    if head_dim > 128 and not INTERPRET and not (bounds and TRITON_VERSION < (3, 4)):
        options["num_warps"] = 8
    if head_dim * (means + 2 * bounds) > 256:
        options["num_stages"] = 1
    return row_chunk, options
