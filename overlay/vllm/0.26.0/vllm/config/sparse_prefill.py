# SPDX-License-Identifier: Apache-2.0
"""prefill-accel adapter: the ``--sparse-prefill-*`` flags of the SPARSE_PREFILL attention backend.

Placed by the prefill-accel overlay. The flags are ``AttentionConfig.sparse_prefill_*`` fields; this
module reads them off the config and hands them to the runtime, whose startup check
(``prefill_accel.engine.startup``: validation naming the flag, one log line) and help texts they share
with the other engines.
"""

from __future__ import annotations

import dataclasses

from prefill_accel.engine.startup import EngineFacts, check_flags
from prefill_accel.flags import BACKEND_NAME, FIELD_PREFIX, SparsePrefillSettings, flag, settings_from_flags

from vllm.config.attention import AttentionConfig

__all__ = ["BACKEND_NAME", "FACTS", "SPARSE_PREFILL_FIELDS", "check_sparse_prefill_flags", "flag",
           "sparse_prefill_settings"]  # fmt: skip

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


def check_sparse_prefill_flags(attention_config: AttentionConfig, logger) -> SparsePrefillSettings | None:
    """The runtime's startup check, with the backend selected when it, or a per-KV-cache-group backend,
    is SPARSE_PREFILL."""
    backends = [attention_config.backend, *attention_config.backend_per_kind.values()]
    selected = any(getattr(backend, "name", None) == BACKEND_NAME for backend in backends)
    return check_flags(flag_values(attention_config), selected, FACTS, logger,
                       chosen=getattr(attention_config.backend, "name", "auto"))  # fmt: skip
