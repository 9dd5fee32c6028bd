# SPDX-License-Identifier: Apache-2.0
"""The ``--sparse-prefill-*`` flags of the SPARSE_PREFILL attention backend: hand-off and startup check.

Placed by the prefill-accel overlay. The flags are ``AttentionConfig.sparse_prefill_*`` fields; this
module hands them to the runtime (``prefill_accel.flags``, shared with the other engines: validation
with the flag named in every error, the kernel's ``SparsePrefillConfig``) and logs the effective
values once at startup.
"""

from __future__ import annotations

import dataclasses

from prefill_accel.flags import (
    BACKEND_NAME,
    FIELD_PREFIX,
    SparsePrefillSettings,
    changed_flags,
    flag,
    settings_from_flags,
)

from vllm.config.attention import AttentionConfig

__all__ = ["BACKEND_NAME", "SPARSE_PREFILL_FIELDS", "check_sparse_prefill_flags", "flag", "sparse_prefill_settings"]

SPARSE_PREFILL_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionConfig) if f.name.startswith(FIELD_PREFIX))
"""The AttentionConfig fields of the backend; each is also an EngineArgs field and a CLI flag."""


def flag_values(attention_config: AttentionConfig) -> dict[str, object]:
    """The ``sparse_prefill_*`` fields, keyed by their suffix (``threshold``, ``min_len``, ...)."""
    return {name.removeprefix(FIELD_PREFIX): getattr(attention_config, name) for name in SPARSE_PREFILL_FIELDS}


def sparse_prefill_settings(attention_config: AttentionConfig) -> SparsePrefillSettings:
    """Validate the flags and build the settings; every error names the flag to change."""
    return settings_from_flags(flag_values(attention_config))


def uses_sparse_prefill(attention_config: AttentionConfig) -> bool:
    """True when the backend, or a per-KV-cache-group backend, is SPARSE_PREFILL."""
    backends = [attention_config.backend, *attention_config.backend_per_kind.values()]
    return any(getattr(backend, "name", None) == BACKEND_NAME for backend in backends)


def check_sparse_prefill_flags(attention_config: AttentionConfig, logger) -> SparsePrefillSettings | None:
    """Startup check: with the SPARSE_PREFILL backend, validate the flags and log the effective values
    once; without it, warn about flags that were changed (they have no effect)."""
    if not uses_sparse_prefill(attention_config):
        changed = changed_flags(flag_values(attention_config))
        if changed:
            logger.warning(
                "%s set but the attention backend is %s; they only apply with --attention-backend %s",
                ", ".join(changed),
                getattr(attention_config.backend, "name", "auto"),
                BACKEND_NAME,
            )
        return None
    settings = sparse_prefill_settings(attention_config)
    logger.info(
        "%s attention: prefill chunks of >= %d tokens use block-sparse attention (%s); "
        "decodes, shorter chunks and sliding-window layers use FlashAttention",
        BACKEND_NAME,
        settings.kernel.min_q_len,
        settings.describe(),
    )
    return settings
