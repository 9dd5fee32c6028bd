"""Prefill attention backend ``sparse_prefill`` for SGLang: long extends block-sparse, the rest dense.

Placed by the prefill-accel overlay; selected with ``--prefill-attention-backend sparse_prefill`` and
tuned with the ``--sparse-prefill-*`` flags (``sglang/srt/sparse_prefill.py``). It wraps the dense
backend the server uses for decode (``--decode-attention-backend``, else ``--attention-backend``):
that backend keeps its metadata for every batch and computes everything except one case. In an
extend batch (a fresh prefill, a chunk of a chunked prefill, a radix-cache hit) where some request's
new tokens have the attention work of a fresh ``--sparse-prefill-min-len`` prompt (SparsePrefillConfig.
long_chunk: that many, or fewer after a long prefix), a layer the kernel can compute writes this
batch's keys and values to the KV pool and runs ``prefill_accel.sparse_prefill_attention`` over the
whole batch, reading every key through ``req_to_token``; the kernel computes the batch's shorter
requests dense itself.

The translation, once per batch on the host lengths: SGLang's KV buffer of one layer,
``(num_slots, kv_heads, head_dim)``, is the kernel's paged cache viewed as
``(num_slots / page_size, page_size, kv_heads, head_dim)``; a request's page ``j`` is the slot of its
token ``j * page_size`` divided by the page size (slots of one page are consecutive); the key
length is prefix + extend, the query offsets come from the extend lengths.

Layers that stay dense for every batch: the first ``--sparse-prefill-dense-layers``, sliding-window
and chunked-local (iRoPE) layers, logit soft-capping, cross and encoder-only attention, head sizes the
kernel lacks, differing K and V head sizes. Batches that stay dense: decodes, target verification,
batches padded beyond their tokens, calls with extra arguments (attention sinks and the like), and
every batch when the KV pool is not the plain token pool (quantized, HND or hybrid layouts).

The dense backend is the instance the server decodes with (patch 0002 hands it over where SGLang
builds its hybrid of a prefill and a decode backend), so its buffers and workspace exist once; its
metadata for an extend batch the kernel takes is planned only if some layer of that batch stays dense.

Built before SGLang captures its CUDA graphs, the backend compiles and tunes the kernels for the
runner's shapes (prefill_accel.engine.warmup), so the first long prompt compiles nothing.
"""

import logging
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from prefill_accel import sparse_prefill_attention
from prefill_accel.engine.layers import LayerTraits, dense_reason
from prefill_accel.engine.warmup import warm_up_logged
from prefill_accel.flags import SparsePrefillSettings
from prefill_accel.layout import BatchLayout

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sparse_prefill import BACKEND, settings_from_server_args

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SparseBatch:
    """An extend batch in the kernel's terms, built once per batch and shared by every layer."""

    page_table: torch.Tensor
    """(batch, max_pages) int32: the pages of each request in order."""
    cu_seqlens_q: torch.Tensor
    """(batch + 1,) int32: query offsets of the requests in the batch's rows."""
    seqlens_k: torch.Tensor
    """(batch,) int32: prefix + extend length of each request."""
    layout: BatchLayout
    total_q: int


def sparse_batch(
    forward_batch: ForwardBatch,
    req_to_token: torch.Tensor,
    page_size: int,
    settings: SparsePrefillSettings,
) -> Optional[SparseBatch]:
    """The kernel's arguments for an extend batch, or None when no request reaches the minimum attention work.

    Reads only host lengths (``extend_seq_lens_cpu``, ``seq_lens_cpu``); the page table is gathered
    on the device from ``req_to_token`` rows of the batch's requests.
    """
    extend_lens = forward_batch.extend_seq_lens_cpu
    if extend_lens is None or forward_batch.seq_lens_cpu is None:
        return None
    seq_lens_cpu = forward_batch.seq_lens_cpu.to(torch.int32)
    if not any(settings.kernel.long_chunk(n, k) for n, k in zip(extend_lens, seq_lens_cpu.tolist())):
        return None
    device = forward_batch.req_pool_indices.device
    cu_seqlens_q_cpu = torch.zeros(len(extend_lens) + 1, dtype=torch.int32)
    cu_seqlens_q_cpu[1:] = torch.cumsum(torch.tensor(extend_lens, dtype=torch.int32), 0)
    max_pages = -(-int(seq_lens_cpu.max()) // page_size)
    first_slots = req_to_token[forward_batch.req_pool_indices, : max_pages * page_size : page_size]
    return SparseBatch(
        page_table=(first_slots // page_size).to(torch.int32),
        cu_seqlens_q=cu_seqlens_q_cpu.to(device),
        seqlens_k=seq_lens_cpu.to(device),
        layout=BatchLayout.build(cu_seqlens_q_cpu, seq_lens_cpu, settings.kernel, device),
        total_q=int(cu_seqlens_q_cpu[-1]),
    )


def paged_view(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """A layer's ``(num_slots, kv_heads, head_dim)`` KV buffer as ``(num_pages, page_size, kv_heads,
    head_dim)``; slots past the last whole page are never allocated to a request."""
    whole = buffer.shape[0] - buffer.shape[0] % page_size
    return buffer[:whole].view(-1, page_size, *buffer.shape[1:])


class SparsePrefillAttnBackend(AttentionBackend):
    """The dense backend's attention, with long extend batches on the block-sparse kernel."""

    def __init__(self, dense: AttentionBackend, settings: SparsePrefillSettings, req_to_token_pool,
                 token_to_kv_pool, page_size: int, dense_is_shared: bool = False):
        super().__init__()
        self.dense = dense
        # The decode side's own instance: SGLang's hybrid backend sets up its graph state.
        self.dense_is_shared = dense_is_shared
        self.settings = settings
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.page_size = page_size
        self.needs_cpu_seq_lens = True  # the batch translation reads seq_lens_cpu
        self.pool_reason = self._pool_reason(token_to_kv_pool)
        if self.pool_reason is not None:
            logger.warning("%s: every batch stays on the dense backend: %s", BACKEND, self.pool_reason)
        self._layer_reasons: Dict[int, Optional[str]] = {}
        self._batch: Optional[SparseBatch] = None
        self._unplanned: Optional[ForwardBatch] = None  # an extend batch the dense backend has not planned

    def __getattr__(self, name):
        # Model code and SGLang's runners read backend-specific attributes (forward_metadata, ...)
        # of the backend they configured: they are the dense backend's, for the current batch.
        if name in ("dense", "_unplanned"):
            raise AttributeError(name)
        return getattr(self._dense(), name)

    @staticmethod
    def _pool_reason(pool) -> Optional[str]:
        """Why the KV pool cannot be read as pages, or None."""
        if type(pool) is not MHATokenToKVPool:
            return f"KV pool {type(pool).__name__} (the kernel reads the plain MHATokenToKVPool)"
        if pool.use_hnd:
            return "HND KV layout (the kernel reads token-major pages)"
        if pool.is_quantized_kv_cache or pool.store_dtype != pool.dtype:
            return f"quantized KV cache ({pool.dtype} stored as {pool.store_dtype})"
        return None

    def layer_dense_reason(self, layer) -> Optional[str]:
        """Why every batch of this layer stays dense, or None; logged once per layer."""
        if layer.layer_id not in self._layer_reasons:
            reason = self._layer_reason(layer)
            self._layer_reasons[layer.layer_id] = reason
            if reason is not None:
                logger.debug("%s: layer %d stays dense: %s", BACKEND, layer.layer_id, reason)
        return self._layer_reasons[layer.layer_id]

    def _layer_reason(self, layer) -> Optional[str]:
        causal = not layer.is_cross_attention and layer.attn_type == AttentionType.DECODER
        window = layer.sliding_window_size
        traits = LayerTraits(
            head_size=layer.qk_head_dim, index=layer.layer_id, name=f"layer {layer.layer_id}",
            attention_type=None if causal else ("cross-attention" if layer.is_cross_attention else str(layer.attn_type)),
            sliding_window=window if window is not None and window > -1 else None, chunked_local=bool(layer.use_irope),
            soft_cap=bool(layer.logit_cap), v_head_size=layer.v_head_dim,
        )  # fmt: skip
        return dense_reason(traits, self.settings)

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        self._batch, self._unplanned = None, None
        if self.pool_reason is None and forward_batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            self._batch = sparse_batch(
                forward_batch, self.req_to_token_pool.req_to_token, self.page_size, self.settings
            )
        if self._batch is None:
            self.dense.init_forward_metadata(forward_batch)
        else:
            self._unplanned = forward_batch  # planned by _dense() if a layer of it stays dense

    def _dense(self) -> AttentionBackend:
        """The dense backend, with the current batch's metadata planned."""
        if self._unplanned is not None:
            batch, self._unplanned = self._unplanned, None
            self.dense.init_forward_metadata(batch)
        return self.dense

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        # Graph-captured batches stay dense: the kernel's grid depends on the batch's lengths.
        self._batch, self._unplanned = None, None
        self.dense.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        self.dense.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if not self.dense_is_shared:
            self.dense.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value()

    # What the base class defines for graphs, speculative verification and indexers is the dense
    # backend's (__getattr__ reaches only what the base class lacks). A batch whose metadata a graph
    # captured or refreshes stays dense, as above.
    @property
    def use_captured_forward_metadata_for_breakable_cuda_graph(self) -> bool:
        return self.dense.use_captured_forward_metadata_for_breakable_cuda_graph

    @property
    def supports_ragged_verify_graph(self) -> bool:
        return self.dense.supports_ragged_verify_graph

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch: ForwardBatch):
        self._batch, self._unplanned = None, None
        return self.dense.init_forward_metadata_for_breakable_cuda_graph_capture(forward_batch)

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(self, capture_metadata, forward_batch: ForwardBatch,
                                                                 **kwargs) -> None:  # fmt: skip
        self._batch, self._unplanned = None, None
        self.dense.prepare_forward_metadata_for_breakable_cuda_graph_replay(capture_metadata, forward_batch, **kwargs)

    def draft_extend_metadata_captured_in_graph(self) -> bool:
        return self.dense.draft_extend_metadata_captured_in_graph()

    def on_after_cuda_graph_warmup(self):
        return self.dense.on_after_cuda_graph_warmup()

    def get_verify_buffers_to_fill_after_draft(self):
        return self.dense.get_verify_buffers_to_fill_after_draft()

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        return self.dense.update_verify_buffers_to_fill_after_draft(spec_info, cuda_graph_bs)

    def support_triton(self):
        return self.dense.support_triton()

    def get_indexer_metadata(self, layer_id: int, forward_batch: ForwardBatch):
        return self._dense().get_indexer_metadata(layer_id, forward_batch)

    def forward_mixed(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, **kwargs):
        return self._dense().forward_mixed(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, **kwargs):
        return self._dense().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, **kwargs):
        batch = self._batch
        if (batch is None or kwargs or self.layer_dense_reason(layer) is not None
                or q.shape[0] != batch.total_q):
            return self._dense().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale
            )
        query = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        output = torch.empty_like(query)
        sparse_prefill_attention(
            query,
            paged_view(self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.page_size),
            paged_view(self.token_to_kv_pool.get_value_buffer(layer.layer_id), self.page_size),
            batch.page_table,
            batch.cu_seqlens_q,
            batch.seqlens_k,
            config=self.settings.kernel,
            softmax_scale=layer.scaling,
            out=output,
            layout=batch.layout,
        )
        return output.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def create_sparse_prefill_backend(runner, decode_backend: Optional[AttentionBackend] = None) -> SparsePrefillAttnBackend:
    """The backend for a model runner: its dense backend is the one the server decodes with, the very
    instance ``decode_backend`` where the caller has built it (SGLang's hybrid setup, patch 0002), else
    a new one of the decode backend's kind."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    _, dense_name = runner.server_args.get_attention_backends()
    if dense_name is None or dense_name == BACKEND or dense_name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"--prefill-attention-backend {BACKEND} hands short extends and decodes to the decode "
            f"backend, which is {dense_name!r}: set --attention-backend or --decode-attention-backend "
            "to a dense backend (e.g. fa3, flashinfer, triton)"
        )
    backend = SparsePrefillAttnBackend(
        dense=decode_backend if decode_backend is not None else ATTENTION_BACKENDS[dense_name](runner),
        settings=settings_from_server_args(runner.server_args),
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool=runner.token_to_kv_pool,
        page_size=runner.page_size,
        dense_is_shared=decode_backend is not None,
    )
    if backend.pool_reason is None:
        warm_up_kernels(runner, backend.settings)
    return backend


def warm_up_kernels(runner, settings: SparsePrefillSettings) -> None:
    """The runtime's warm-up for this runner's shapes: its KV pool's heads (per rank), head size, dtype
    and pages, the model's query heads per KV head, chunks of ``--chunked-prefill-size`` (the context
    length when prefills are not chunked) within the context length."""
    pool, model = runner.token_to_kv_pool, runner.model_config
    group = model.num_attention_heads // model.get_num_kv_heads(1)
    size = runner.server_args.chunked_prefill_size
    chunk = size if size is not None and size > 0 else model.context_len
    warm_up_logged(
        logger, f"{pool.head_num * group} / {pool.head_num} heads, d={pool.head_dim}",
        num_heads=pool.head_num * group, num_kv_heads=pool.head_num, head_dim=pool.head_dim, dtype=pool.dtype,
        page_size=runner.page_size, config=settings.kernel, chunk_tokens=chunk, device=torch.device(runner.device),
        max_context=model.context_len,
    )  # fmt: skip
