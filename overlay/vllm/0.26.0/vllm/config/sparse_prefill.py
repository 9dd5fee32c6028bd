# SPDX-License-Identifier: Apache-2.0
"""prefill-accel adapter: the ``--sparse-prefill-*`` flags of the SPARSE_PREFILL attention backend.

Placed by the prefill-accel overlay. The flags are ``AttentionConfig.sparse_prefill_*`` fields; this
module reads them off the config and hands them to the runtime, whose startup checks
(``prefill_accel.engine.startup``: validation naming the flag, one log line; a warning when the
scheduler settings leave the backend inert) and help texts they share with the other engines.
"""

from __future__ import annotations

import dataclasses

from prefill_accel.engine.startup import ChunkLimit, EngineFacts, check_flags, check_schedule
from prefill_accel.flags import BACKEND_NAME, FIELD_PREFIX, SparsePrefillSettings, flag, settings_from_flags

from vllm.config.attention import AttentionConfig

__all__ = ["BACKEND_NAME", "FACTS", "SPARSE_PREFILL_FIELDS", "check_sparse_prefill_flags",
           "check_sparse_prefill_schedule", "flag", "sparse_prefill_settings"]  # fmt: skip

FACTS = EngineFacts(
    backend=BACKEND_NAME, selector="attention backend", select_hint=f"--attention-backend {BACKEND_NAME}",
    dense="FlashAttention", dense_rest="decodes, shorter chunks and sliding-window layers",
)  # fmt: skip

SPARSE_PREFILL_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionConfig) if f.name.startswith(FIELD_PREFIX))
"""The AttentionConfig fields of the backend; each is also an EngineArgs field and a CLI flag."""


def flag_values(attention_config: AttentionConfig) -> dict[str, object]:
    """The ``sparse_prefill_*`` fields, keyed by their suffix (``threshold``, ``min_len``, ...)."""
    return {name.removeprefix(FIELD_PREFIX): getattr(attention_config, name) for name in SPARSE_PREFILL_FIELDS}


def sparse_prefill_settings(attention_config: AttentionConfig) -> SparsePrefillSettings:
    """Validate the flags and build the settings; every error names the flag to change."""
    return settings_from_flags(flag_values(attention_config))


def _selected(attention_config: AttentionConfig) -> bool:
    """Whether the backend, or a per-KV-cache-group backend, is SPARSE_PREFILL."""
    backends = [attention_config.backend, *attention_config.backend_per_kind.values()]
    return any(getattr(backend, "name", None) == BACKEND_NAME for backend in backends)


def check_sparse_prefill_flags(attention_config: AttentionConfig, logger) -> SparsePrefillSettings | None:
    """The runtime's startup check of the flags."""
    return check_flags(flag_values(attention_config), _selected(attention_config), FACTS, logger,
                       chosen=getattr(attention_config.backend, "name", "auto"))  # fmt: skip


def schedule_limits(vllm_config) -> list[ChunkLimit]:
    """What bounds one request's prefill tokens in a V1 step: the step's token budget, the model length,
    and, where set, the scheduled-token budget and the chunk cap of long prefills."""
    scheduler = vllm_config.scheduler_config
    limits = [ChunkLimit("--max-num-batched-tokens", scheduler.max_num_batched_tokens),
              ChunkLimit("--max-model-len", vllm_config.model_config.max_model_len, fix="a longer --max-model-len")]
    if scheduler.max_num_scheduled_tokens is not None:
        limits.append(ChunkLimit("--max-num-scheduled-tokens", scheduler.max_num_scheduled_tokens))
    if scheduler.long_prefill_token_threshold > 0:
        limits.append(ChunkLimit("--long-prefill-token-threshold", scheduler.long_prefill_token_threshold))
    return limits


def check_sparse_prefill_schedule(vllm_config, logger) -> str | None:
    """The runtime's check that the resolved scheduler settings let a prefill chunk reach the minimum
    attention work within the model length; one warning naming the setting when they do not."""
    attention_config = vllm_config.attention_config
    settings = sparse_prefill_settings(attention_config) if _selected(attention_config) else None
    return check_schedule(settings, schedule_limits(vllm_config), FACTS, logger,
                          max_context=vllm_config.model_config.max_model_len)
