"""What every Triton kernel of the package shares: the interpreter switch, the dot product that is
exact under it, whether this Triton has tensor descriptors (TMA), and reads of K/V rows through a
page table.

The modules of ``ops`` that hold kernels keep their annotations evaluated (no postponed annotations):
Triton 3.0's interpreter recognises a ``tl.constexpr`` parameter by its annotation object only."""

import os
import warnings

import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton < 3.4 (torch 2.4 brings 3.0): every K/V read goes through the page table
    TensorDescriptor = None

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter (triton 3.6-3.8) multiplies bf16 tl.dot operands as raw integers. Products of
# bf16/fp16 values are exact in float32, so upcasting first computes what the tensor cores do.
DOT_IN_FP32 = tl.constexpr(INTERPRET)
TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
TENSOR_DESCRIPTORS = TensorDescriptor is not None
"""Whether K/V tiles can be brought by bulk tensor copies (TMA): triton.tools.tensor_descriptor, Triton >= 3.4."""
TMA_NEEDS_TRITON = "3.4"


def jit_per_batch(*names: str):
    """triton.jit for a kernel whose arguments ``names`` change from one batch to the next without
    changing what it computes: lengths and counts, the strides of per-batch tensors, and length or
    page-table tensors an engine passes as slices of its own (their alignment follows the first request's
    index). Triton compiles a kernel again for each new class of an argument's value (an int equal to
    1, an int or address divisible by 16), which a server would meet inside a request; unspecialised,
    these compile once per engine shape, at warm-up (engine.warmup). Data tensors and the strides that
    address them stay specialised: their alignment lets loads and stores be vectorised."""
    return triton.jit(do_not_specialize=list(names))


@triton.jit
def dot(a, b):
    if DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def kv_slots(page_table_row, pos, PAGE_SIZE: tl.constexpr, mask):
    """Page and slot of the cache rows holding token positions ``pos`` of one sequence."""
    page = tl.load(page_table_row + pos // PAGE_SIZE, mask=mask).to(tl.int64)  # masked lanes are never read through
    return page, (pos % PAGE_SIZE).to(tl.int64)


@triton.jit
def kv_tile(cache, desc, pt_row, k_first, kv_head, kv_column, stride_p, stride_s, stride_h, valid,
            HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """The BLOCK_N cache rows of one sequence's keys (or values) from position ``k_first`` on.

    With TMA the tile lies in one page (PAGE_SIZE is a multiple of BLOCK_N) and one bulk copy
    through ``desc``, the cache viewed as (rows, heads * HEAD_DIM), brings it; rows past the
    sequence come as they lie in the page, and the caller masks them. Otherwise each row is
    gathered through the page table, rows not ``valid`` (None: all are) read as zeros."""
    if TMA:
        page = tl.load(pt_row + k_first // PAGE_SIZE)
        return desc.load([page * PAGE_SIZE + k_first % PAGE_SIZE, kv_column])
    else:
        dims = tl.arange(0, HEAD_DIM)
        page, slot = kv_slots(pt_row, k_first + tl.arange(0, BLOCK_N), PAGE_SIZE, valid)
        rows = page * stride_p + slot * stride_s + kv_head * stride_h
        if valid is None:
            tile = tl.load(cache + rows[:, None] + dims[None, :])
        else:
            tile = tl.load(cache + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        return tile


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
