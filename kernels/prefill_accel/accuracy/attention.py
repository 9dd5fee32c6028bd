"""Sparse prefill plugged into transformers models through the attention-function registry.

:func:`register` adds one attention implementation, ``"prefill_accel"``. In the prefill forward of
a batch-1 prompt (query length == key length) its full-attention layers repack transformers'
(B, H, L, D) tensors into the package's packed/paged layout and run the block-sparse path; decode
steps, sliding-window layers and layers outside the sparse set go to transformers' SDPA function
unchanged. What a forward does is set by the :class:`AttentionRun` made current with :func:`use`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from ..ops import attention_reference, search_reference
from ..api import block_sparse_attention, select_blocks
from ..config import SparsePrefillConfig
from ..layout import BlockIndex
from .metrics import block_attention_mass, relative_error, selection_quality

ATTN_IMPLEMENTATION = "prefill_accel"
BACKENDS = ("triton", "reference")
PAGE_SIZES = (1, 16)


@dataclass
class LayerRecord:
    """What one sparse layer measured in a compare forward."""

    layer: int
    density: float
    rel_err: float
    recall: float | None = None
    oracle_density: float | None = None
    oracle_density_95: float | None = None


@dataclass
class AttentionRun:
    """How the registered attention function behaves during the forwards that use it.

    ``mode``:
        ``"dense"``: every layer runs SDPA (the baseline).
        ``"sparse"``: sparse layers return the sparse output.
        ``"compare"``: sparse layers compute dense and sparse outputs on the same q/k/v, record
        their difference (and, for ``analysis_layers``, the selection quality) and return the dense
        output, so every layer sees the dense model's activations.
        ``"capture"``: sparse layers in ``capture_layers`` store q, k, v as (L, H, D) bfloat16 on the
        CPU in ``captured`` and run dense.
    """

    mode: str = "dense"
    config: SparsePrefillConfig = field(default_factory=SparsePrefillConfig)
    backend: str = "reference"
    page_size: int = 16
    sparse_layers: frozenset[int] = frozenset()
    analysis_layers: frozenset[int] = frozenset()
    capture_layers: frozenset[int] = frozenset()
    records: list[LayerRecord] = field(default_factory=list)
    kept_blocks: int = 0
    causal_blocks: int = 0
    captured: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    masses: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    """Block attention masses by (length, layer, block size), kept across the compare forwards of a
    sweep: a compare forward runs the dense model's activations, so a layer's mass at a length does
    not depend on the configuration, and at 128K computing it costs more than the rest of a forward."""

    def __post_init__(self) -> None:
        if self.mode not in ("dense", "sparse", "compare", "capture"):
            raise ValueError(f"AttentionRun.mode must be dense, sparse, compare or capture, got {self.mode!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"AttentionRun.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"AttentionRun.page_size must be one of {PAGE_SIZES}, got {self.page_size}")

    @property
    def density(self) -> float:
        """Kept over causal blocks over every sparse layer and KV head this run has computed."""
        return self.kept_blocks / max(self.causal_blocks, 1)


_current = AttentionRun()


@contextlib.contextmanager
def use(run: AttentionRun):
    """Make ``run`` drive the registered attention function inside the ``with`` block."""
    global _current
    previous, _current = _current, run
    try:
        yield run
    finally:
        _current = previous


def paged_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_size: int):
    """One sequence's (L, H, D) q, k, v as the package's packed queries and paged KV cache.

    Returns q (L, Hq, D), k_cache and v_cache (num_pages, page_size, Hkv, D), page_table (1, num_pages)
    int32, cu_seqlens_q (2,) int32 and seqlens_k (1,) int32.
    """
    length = q.shape[0]
    num_pages = -(-length // page_size)
    pad = num_pages * page_size - length

    def to_cache(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(num_pages, page_size, *x.shape[1:]).contiguous()

    device = q.device
    page_table = torch.arange(num_pages, dtype=torch.int32, device=device).unsqueeze(0)
    cu_seqlens_q = torch.tensor([0, length], dtype=torch.int32, device=device)
    seqlens_k = torch.tensor([length], dtype=torch.int32, device=device)
    return q.contiguous(), to_cache(k), to_cache(v), page_table, cu_seqlens_q, seqlens_k


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: SparsePrefillConfig,
    scale: float,
    backend: str = "reference",
    page_size: int = 16,
) -> tuple[torch.Tensor, BlockIndex]:
    """Causal block-sparse attention of one sequence's q (L, Hq, D), k, v (L, Hkv, D).

    Returns the output (L, Hq, D) in q's dtype and the block index the search built. ``backend``
    ``"triton"`` goes through the public API (the Triton kernels, or its dense fallback where they
    cannot run); ``"reference"`` runs the PyTorch references of the same math.
    """
    inputs = paged_inputs(q, k, v, page_size)
    packed_q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k = inputs
    if backend == "triton":
        index = select_blocks(packed_q, k_cache, page_table, cu_seqlens_q, seqlens_k, config, scale)
        out, _ = block_sparse_attention(*inputs, index, scale, config.mean_correction)
        return out, index
    index = search_reference.select_blocks(packed_q, k_cache, page_table, cu_seqlens_q, seqlens_k, config, scale)
    out, _ = attention_reference.block_masked_attention(*inputs, index, scale, config.mean_correction)
    return out.to(q.dtype), index


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def prefill_accel_attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
    """The registered attention function; signature and returns as transformers' ``sdpa_attention_forward``.

    query (B, Hq, Lq, D), key/value (B, Hkv, Lk, D); returns ((B, Lq, Hq, D), None).
    """
    run = _current
    layer = getattr(module, "layer_idx", None)
    is_prefill = query.shape[0] == 1 and query.shape[2] == key.shape[2]
    kwargs.update(scaling=scaling, sliding_window=sliding_window)
    if run.mode == "dense" or sliding_window is not None or not is_prefill or layer not in run.sparse_layers:
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    if getattr(module.config, "attn_logit_softcapping", None) is not None:
        raise NotImplementedError("sparse prefill does not implement attention logit soft-capping")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (L, H, D)
    if run.mode == "capture":
        if layer in run.capture_layers:
            run.captured[layer] = {name: x.to("cpu", torch.bfloat16).contiguous() for name, x in zip("qkv", (q, k, v))}
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    sparse_out, index = sparse_attention(q, k, v, run.config, scale, run.backend, run.page_size)
    run.kept_blocks += int(index.counts.long().sum())
    run.causal_blocks += index.layout.causal_blocks() * index.num_kv_heads
    if run.mode == "sparse":
        return sparse_out.unsqueeze(0), None
    dense_out, _ = _sdpa(module, query, key, value, attention_mask, **kwargs)
    record = LayerRecord(layer=layer, density=index.density(), rel_err=relative_error(sparse_out, dense_out[0]))
    if layer in run.analysis_layers:
        key = (q.shape[0], layer, run.config.block_size)
        mass = run.masses.get(key)
        if mass is None:
            mass = run.masses[key] = block_attention_mass(q, k, run.config.block_size, scale)
        quality = selection_quality(mass, index.to_mask())
        record.recall = quality["recall"]
        record.oracle_density = quality["oracle_density"]
        record.oracle_density_95 = quality["oracle_density_95"]
    run.records.append(record)
    return dense_out, None


def register() -> None:
    """Register ``"prefill_accel"`` with transformers' attention and attention-mask registries.

    Masks are built as for SDPA: the dense paths hand them to SDPA unchanged.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, prefill_accel_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
