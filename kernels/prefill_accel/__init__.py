"""prefill-accel: training-free block-sparse prefill attention over a paged KV cache.

The engine-agnostic core: Triton kernels for block selection and block-sparse FlashAttention,
PyTorch references beside them, and the public functions engines call.
"""

from .api import block_sparse_attention, select_blocks, sparse_prefill_attention
from .config import SparsePrefillConfig
from .layout import BatchLayout, BlockIndex

__version__ = "0.1.0"

__all__ = [
    "BatchLayout",
    "BlockIndex",
    "SparsePrefillConfig",
    "__version__",
    "block_sparse_attention",
    "select_blocks",
    "sparse_prefill_attention",
]
