"""prefill-accel: training-free block-sparse prefill attention over a paged KV cache.

The engine-agnostic core: Triton kernels for block selection and block-sparse FlashAttention,
PyTorch references beside them, and the public functions engines call. The public names are
imported on first use, so the patch tooling, the serving tools and the CLI, which live in this
package too, run without torch and triton.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "BatchLayout": "layout",
    "BlockIndex": "layout",
    "SparsePrefillConfig": "config",
    "block_sparse_attention": "api",
    "select_blocks": "api",
    "sparse_prefill_attention": "api",
}

__all__ = ["__version__", *sorted(_PUBLIC)]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
