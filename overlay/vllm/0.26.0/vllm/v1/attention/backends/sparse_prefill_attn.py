# SPDX-License-Identifier: Apache-2.0
"""Attention backend SPARSE_PREFILL: vLLM's FlashAttention, with long prefill chunks on block-sparse attention.

Placed by the prefill-accel overlay; selected with ``--attention-backend SPARSE_PREFILL`` and tuned
with the ``--sparse-prefill-*`` flags. Everything is FlashAttention (same KV cache layout and
update, same metadata, same kernels, same CUDA-graph support) except one thing: in a step where a
request's query length reaches ``--sparse-prefill-min-len``, that request's rows are computed by
``prefill_accel.sparse_prefill_attention`` reading the paged KV cache through the block table,
while the other requests of the step go through upstream's FlashAttention forward.

The metadata builder compiles and tunes the kernels for its layers' shapes at startup
(``prefill_accel.engine.warmup``). Layers that the kernel cannot compute stay on FlashAttention for
every step: sliding-window
layers (e.g. Gemma 3's local layers), ALiBi, logit soft-capping, attention sinks, quantized KV
caches, non-decoder attention, decode context parallelism, head sizes the kernel lacks, and the
first ``--sparse-prefill-dense-layers`` layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from prefill_accel import BatchLayout, sparse_prefill_attention
from prefill_accel.engine.layers import LayerTraits, dense_reason
from prefill_accel.engine.startup import binding_limit
from prefill_accel.engine.warmup import warm_up_logged

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.config.sparse_prefill import BACKEND_NAME, schedule_limits, sparse_prefill_settings
from vllm.logger import init_logger
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.sparse_prefill_runs import (
    RequestRun,
    forward_runs,
    split_long_prefills,
    with_layouts,
)
from vllm.v1.kv_cache_interface import AttentionSpec

logger = init_logger(__name__)


class SparsePrefillAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[SparsePrefillAttentionImpl]:
        return SparsePrefillAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SparsePrefillMetadataBuilder]:
        return SparsePrefillMetadataBuilder


@dataclass
class SparsePrefillMetadata(FlashAttentionMetadata):
    sparse_runs: tuple[RequestRun, ...] | None = None
    """The step cut into runs of requests for each path; None when every request is below the minimum."""
    sparse_layout: BatchLayout | None = None
    """Set on the metadata of one sparse run: the kernel's layout of its requests."""


class SparsePrefillMetadataBuilder(FlashAttentionMetadataBuilder):
    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kernel_config = sparse_prefill_settings(vllm_config.attention_config).kernel
        self.max_model_len = vllm_config.model_config.max_model_len
        # Built once the KV cache exists, before CUDA graphs are captured: compile and tune the kernels
        # for this group's shapes now, not inside the first long prompt.
        heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        if kv_cache_spec.dtype in (torch.float16, torch.bfloat16):
            warm_up_logged(
                logger, f"{heads} / {kv_cache_spec.num_kv_heads} heads, d={kv_cache_spec.head_size}",
                num_heads=heads, num_kv_heads=kv_cache_spec.num_kv_heads, head_dim=kv_cache_spec.head_size,
                dtype=kv_cache_spec.dtype, page_size=kv_cache_spec.block_size, config=self.kernel_config,
                chunk_tokens=binding_limit(schedule_limits(vllm_config)).tokens, device=device,
                max_context=self.max_model_len,
            )  # fmt: skip

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> FlashAttentionMetadata:
        """Upstream's metadata, unchanged for a step with no prefill chunk of the minimum attention work
        (every decode step, every short prefill); with one, upstream's fields plus the step's runs."""
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        runs = None
        # The longest chunk at the longest context bounds every request's work: most steps stop here.
        if self.kernel_config.long_chunk(common_attn_metadata.max_query_len, common_attn_metadata.max_seq_len):
            # Exact for prefill rows, which are all the sparse runs hold; read once per step otherwise.
            seq_lens_cpu = common_attn_metadata.seq_lens_cpu_upper_bound
            if seq_lens_cpu is None:
                seq_lens_cpu = common_attn_metadata.seq_lens_cpu
            runs = split_long_prefills(common_attn_metadata.query_start_loc_cpu, seq_lens_cpu,
                                       common_attn_metadata.num_reqs, self.kernel_config)  # fmt: skip
        if runs is None:
            return metadata
        if not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            runs = with_layouts(
                runs, common_attn_metadata.query_start_loc_cpu, seq_lens_cpu, self.kernel_config, self.device
            )
        fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return SparsePrefillMetadata(**fields, sparse_runs=runs)

    def use_cascade_attention(self, common_prefix_len: int, query_lens: np.ndarray, **kwargs) -> bool:
        # Cascade attention runs the whole step as one shared-prefix pass, which cannot be split by request.
        # The contexts are not given here: the model length bounds them.
        if len(query_lens) and self.kernel_config.long_chunk(int(query_lens.max()), self.max_model_len):
            return False
        return super().use_cascade_attention(common_prefix_len=common_prefix_len, query_lens=query_lens, **kwargs)


class SparsePrefillAttentionImpl(FlashAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = sparse_prefill_settings(get_current_vllm_config().attention_config)
        self.dense_reason: str | None = None
        self._layer_checked = False

    def _check_layer(self, layer: torch.nn.Module) -> None:
        """The runtime's decision for this layer, made at its first forward, where its name (and so its
        index, for --sparse-prefill-dense-layers) is known."""
        from vllm.model_executor.models.utils import extract_layer_index

        self._layer_checked = True
        try:
            index = extract_layer_index(layer.layer_name)
        except (AssertionError, ValueError):
            index = None
        traits = LayerTraits(
            head_size=self.head_size, index=index, name=layer.layer_name,
            attention_type=None if self.attn_type == AttentionType.DECODER else str(self.attn_type),
            sliding_window=None if self.sliding_window == (-1, -1) else self.sliding_window[0] + 1,
            alibi=self.alibi_slopes is not None, soft_cap=bool(self.logits_soft_cap), sinks=self.sinks is not None,
            quantized_kv=self.kv_cache_dtype if is_quantized_kv_cache(self.kv_cache_dtype) else None,
            context_parallel=self.dcp_world_size > 1,
        )  # fmt: skip
        self.dense_reason = dense_reason(traits, self.settings)
        if self.dense_reason is not None:
            logger.debug("%s: layer %s stays dense: %s", BACKEND_NAME, layer.layer_name, self.dense_reason)

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self._layer_checked:
            self._check_layer(layer)
        runs = getattr(attn_metadata, "sparse_runs", None)
        if (
            runs is None
            or self.dense_reason is not None
            or output_scale is not None
            or output_block_scale is not None
            or _needs_whole_batch(attn_metadata)
            or (query.is_cuda and torch.cuda.is_current_stream_capturing())
        ):
            # A captured CUDA graph replays upstream's kernels; the sparse path (host-side
            # block layout) runs eagerly only.
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )

        # (B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D)), the same views upstream's forward reads.
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

        def dense(rows: slice, metadata: FlashAttentionMetadata) -> None:
            FlashAttentionImpl.forward(self, layer, query[rows], key, value, kv_cache, metadata, output[rows])

        def sparse(rows: slice, metadata: FlashAttentionMetadata) -> None:
            sparse_prefill_attention(
                query[rows],
                key_cache,
                value_cache,
                metadata.block_table,
                metadata.query_start_loc,
                metadata.seq_lens,
                config=self.settings.kernel,
                softmax_scale=self.scale,
                out=output[rows],
                layout=metadata.sparse_layout,
            )

        forward_runs(runs, attn_metadata, dense, sparse)
        return output


def _needs_whole_batch(attn_metadata: FlashAttentionMetadata) -> bool:
    """Step features that upstream's forward applies to the batch as a whole (cascade attention,
    per-request causality, multimodal prefix-LM ranges, R-SWA): such a step is not split."""
    return (
        attn_metadata.use_cascade
        or attn_metadata.causal is not True
        or attn_metadata.mm_prefix_range_tensor is not None
        or attn_metadata.rswa_prefix_lens is not None
    )
