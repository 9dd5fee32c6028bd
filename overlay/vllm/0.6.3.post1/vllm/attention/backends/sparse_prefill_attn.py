"""Attention backend SPARSE_PREFILL for vLLM 0.6.3 (V0): FlashAttention, long prefill chunks block-sparse.

Placed by the prefill-accel overlay; selected with ``VLLM_ATTENTION_BACKEND=SPARSE_PREFILL`` and tuned
with the ``--sparse-prefill-*`` flags (``vllm/sparse_prefill.py``). Everything is FlashAttention (KV
cache layout and update, metadata, decode kernels, CUDA graphs for decode batches) except one thing:
in a step where a prefill's query length reaches ``--sparse-prefill-min-len``, that request's rows are
computed by ``prefill_accel.sparse_prefill_attention`` reading the paged KV cache through the block
table, while the step's other prefills and its decodes go through FlashAttention as upstream.

Layers the kernel cannot compute stay on FlashAttention for every step: ALiBi, logit soft-capping,
quantized KV caches, head sizes the kernel lacks, the first ``--sparse-prefill-dense-layers`` layers.
A step whose prefills' block tables do not reach every key (no chunked prefill: empty tables, or a
prefix-cache hit listing only the cached blocks) is computed by FlashAttention too: the kernel reads
keys through the block table.
"""

import re
from typing import Optional, Tuple, Type

import torch
from prefill_accel import sparse_prefill_attention
from prefill_accel.engine.layers import LayerTraits, dense_reason
from prefill_accel.flags import BACKEND_NAME, SparsePrefillSettings
from prefill_accel.runs import RequestRun, split_long_prefills, with_layouts

from vllm import _custom_ops as ops
from vllm.attention.backends.abstract import AttentionType
from vllm.attention.backends.flash_attn import (FlashAttentionBackend,
                                                FlashAttentionImpl,
                                                FlashAttentionMetadata,
                                                flash_attn_varlen_func,
                                                flash_attn_with_kvcache)
from vllm.logger import init_logger

logger = init_logger(__name__)

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


class SparsePrefillAttentionBackend(FlashAttentionBackend):

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> Type["SparsePrefillAttentionImpl"]:
        return SparsePrefillAttentionImpl


class SparsePrefillAttentionImpl(FlashAttentionImpl):

    settings: Optional[SparsePrefillSettings] = None
    dense_reason: Optional[str] = "not configured"
    layer_name: Optional[str] = None

    def configure_sparse_prefill(self,
                                 settings: Optional[SparsePrefillSettings],
                                 layer_name: str) -> None:
        """Called by the Attention layer with the engine's settings and the layer's name (empty where
        the model file gives none; the model loader names it once the model is built,
        vllm/sparse_prefill.py): the runtime decides whether the layer may go sparse."""
        self.settings = settings
        self.layer_name = layer_name
        index = _LAYER_INDEX.search(f".{layer_name}.")
        traits = LayerTraits(
            head_size=self.head_size,
            index=int(index.group(1)) if index else None,
            name=layer_name,
            alibi=self.alibi_slopes is not None,
            soft_cap=bool(self.logits_soft_cap),
            quantized_kv=(None if self.kv_cache_dtype == "auto" else
                          self.kv_cache_dtype))
        self.dense_reason = dense_reason(traits, settings)
        if self.dense_reason is not None:
            logger.debug("%s: layer %s stays dense: %s", BACKEND_NAME,
                         layer_name, self.dense_reason)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        attn_type: AttentionType = AttentionType.DECODER,
    ) -> torch.Tensor:
        prefill = attn_metadata.prefill_metadata
        if (self.dense_reason is not None or attn_type != AttentionType.DECODER
                or prefill is None or kv_cache.numel() == 0
                or not self.settings.kernel.long_chunk(
                    prefill.max_query_len, prefill.max_prefill_seq_len)
                or not _block_tables_cover(prefill, kv_cache.shape[2])):
            return super().forward(query, key, value, kv_cache, attn_metadata,
                                   k_scale, v_scale, attn_type)
        runs = prefill_runs(attn_metadata, self.settings, query.device)
        if runs is None:
            return super().forward(query, key, value, kv_cache, attn_metadata,
                                   k_scale, v_scale, attn_type)
        return self._forward_runs(query, key, value, kv_cache, attn_metadata,
                                  runs, k_scale, v_scale)

    def _forward_runs(self, query, key, value, kv_cache,
                      attn_metadata: FlashAttentionMetadata,
                      runs: Tuple[RequestRun, ...], k_scale: float,
                      v_scale: float) -> torch.Tensor:
        """Upstream's unified FlashAttention forward with the long prefills' rows on the kernel."""
        num_tokens = query.shape[0]
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        ops.reshape_and_cache_flash(key, value, key_cache, value_cache,
                                    attn_metadata.slot_mapping.flatten(),
                                    self.kv_cache_dtype, k_scale, v_scale)
        output = torch.empty_like(query)
        prefill = attn_metadata.prefill_metadata
        for run in runs:
            rows, reqs = run.rows, run.requests
            if run.sparse:
                sparse_prefill_attention(
                    query[rows],
                    key_cache,
                    value_cache,
                    prefill.block_tables[reqs],
                    prefill.query_start_loc[run.req_start:run.req_end + 1] -
                    run.token_start,
                    prefill.seq_lens_tensor[reqs],
                    config=self.settings.kernel,
                    softmax_scale=self.scale,
                    out=output[rows],
                    layout=run.layout)
                continue
            seq_start = prefill.seq_start_loc[run.req_start:run.req_end + 1]
            output[rows] = flash_attn_varlen_func(
                q=query[rows],
                k=key_cache,
                v=value_cache,
                cu_seqlens_q=prefill.query_start_loc[run.req_start:run.req_end
                                                     + 1] - run.token_start,
                max_seqlen_q=run.max_query_len,
                cu_seqlens_k=seq_start - seq_start[0],
                max_seqlen_k=max(prefill.seq_lens[reqs]),
                softmax_scale=self.scale,
                causal=True,
                alibi_slopes=self.alibi_slopes,
                block_table=prefill.block_tables[reqs],
                softcap=self.logits_soft_cap,
            )
        decode = attn_metadata.decode_metadata
        if decode is not None:
            # Chunked prefill does not run with speculative decoding: one query per decode.
            num_prefill_tokens = attn_metadata.num_prefill_tokens
            output[num_prefill_tokens:] = flash_attn_with_kvcache(
                q=query[num_prefill_tokens:].unsqueeze(1),
                k_cache=key_cache,
                v_cache=value_cache,
                block_table=decode.block_tables,
                cache_seqlens=decode.seq_lens_tensor,
                softmax_scale=self.scale,
                causal=True,
                alibi_slopes=self.alibi_slopes,
                softcap=self.logits_soft_cap,
            ).squeeze(1)
        return output.view(num_tokens, self.num_heads * self.head_size)


def _block_tables_cover(prefill: FlashAttentionMetadata,
                        page_size: int) -> bool:
    """Whether the prefills' block tables reach every key of their sequences. Without chunked prefill
    V0 leaves them empty, and a prefix-cache hit lists only the cached blocks: such steps stay on
    FlashAttention, which reads those keys from the step's own tensors."""
    tables = prefill.block_tables
    return (tables is not None and tables.numel() > 0
            and tables.shape[1] * page_size >= max(prefill.seq_lens))


def prefill_runs(attn_metadata: FlashAttentionMetadata,
                 settings: SparsePrefillSettings,
                 device: torch.device) -> Optional[Tuple[RequestRun, ...]]:
    """The step's prefills cut into runs for each path, with the sparse runs' layouts; computed by the
    first layer of the step (one read of the query offsets) and kept on the metadata for the others.
    None when no prefill reaches the minimum length."""
    cached: Optional[Tuple] = getattr(attn_metadata, "_prefill_accel_runs",
                                      None)
    if cached is not None and cached[0] is settings:
        return cached[1]
    prefill = attn_metadata.prefill_metadata
    query_start_loc = prefill.query_start_loc.cpu()
    seq_lens = torch.tensor(prefill.seq_lens, dtype=torch.int32)
    runs = split_long_prefills(query_start_loc, seq_lens,
                               prefill.num_prefills, settings.kernel)
    if runs is not None:
        runs = with_layouts(runs, query_start_loc, seq_lens, settings.kernel,
                            device)
    attn_metadata._prefill_accel_runs = (settings, runs)
    return runs

