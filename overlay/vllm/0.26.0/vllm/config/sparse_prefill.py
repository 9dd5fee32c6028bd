# SPDX-License-Identifier: Apache-2.0
"""The ``--sparse-prefill-*`` flags of the SPARSE_PREFILL attention backend: hand-off and startup check.

Placed by the prefill-accel overlay. The flags are ``AttentionConfig.sparse_prefill_*`` fields; this
module turns them into the runtime's ``prefill_accel.SparsePrefillConfig`` (which validates them),
names the offending flag in every error, and logs the effective values once at startup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.config.attention import AttentionConfig

if TYPE_CHECKING:
    from prefill_accel import SparsePrefillConfig

BACKEND_NAME = "SPARSE_PREFILL"
FIELD_PREFIX = "sparse_prefill_"
SPARSE_PREFILL_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionConfig) if f.name.startswith(FIELD_PREFIX))
"""The AttentionConfig fields of the backend; each is also an EngineArgs field and a CLI flag."""
# AttentionConfig field suffix -> SparsePrefillConfig field, where the flag reads better than the kernel name.
KERNEL_FIELD = {"min_len": "min_q_len"}


def flag(field: str) -> str:
    """``sparse_prefill_min_len`` or ``min_len`` -> ``--sparse-prefill-min-len``."""
    suffix = field.removeprefix(FIELD_PREFIX)
    return "--" + (FIELD_PREFIX + suffix).replace("_", "-")


def kernel_field(suffix: str) -> str:
    """The SparsePrefillConfig field a flag sets: ``min_len`` -> ``min_q_len``, ``threshold`` -> ``threshold``."""
    return KERNEL_FIELD.get(suffix, suffix)


def flag_values(attention_config: AttentionConfig) -> dict[str, object]:
    """The ``sparse_prefill_*`` fields, keyed by their suffix (``threshold``, ``min_len``, ...)."""
    return {name.removeprefix(FIELD_PREFIX): getattr(attention_config, name) for name in SPARSE_PREFILL_FIELDS}


@dataclass(frozen=True)
class SparsePrefillSettings:
    """What the backend runs with: the kernel's configuration and the layers kept dense."""

    kernel: SparsePrefillConfig
    dense_layers: int

    def describe(self) -> str:
        """The effective value of every flag, as ``--flag=value`` in the order of ``--help``."""
        values = []
        for name in SPARSE_PREFILL_FIELDS:
            suffix = name.removeprefix(FIELD_PREFIX)
            value = self.dense_layers if suffix == "dense_layers" else getattr(self.kernel, kernel_field(suffix))
            values.append(f"{flag(name)}={value}")
        return " ".join(values)


def sparse_prefill_settings(attention_config: AttentionConfig) -> SparsePrefillSettings:
    """Validate the flags and build the settings; every error names the flag to change."""
    try:
        from prefill_accel import SparsePrefillConfig
    except ImportError as error:
        raise ImportError(
            f"--attention-backend {BACKEND_NAME} needs the prefill-accel runtime package "
            "(install it into this environment: pip install prefill-accel)"
        ) from error
    values = flag_values(attention_config)
    dense_layers = values.pop("dense_layers")
    if isinstance(dense_layers, bool) or not isinstance(dense_layers, int) or dense_layers < 0:
        raise ValueError(f"{flag('dense_layers')} must be an int >= 0, got {dense_layers!r}")
    kernel_values = {kernel_field(name): value for name, value in values.items()}
    try:
        kernel = SparsePrefillConfig(**kernel_values)
    except (TypeError, ValueError) as error:
        message = str(error)
        for name in values:
            message = message.replace(f"SparsePrefillConfig.{kernel_field(name)}", flag(name))
        raise ValueError(f"invalid sparse prefill flag: {message}") from error
    if kernel.min_q_len < kernel.block_size:
        raise ValueError(
            f"{flag('min_len')}={kernel.min_q_len} is below {flag('block_size')}={kernel.block_size}: "
            "a chunk shorter than one block has no key block to skip, and decodes must stay on "
            f"FlashAttention; use {flag('min_len')} >= {kernel.block_size}"
        )
    return SparsePrefillSettings(kernel=kernel, dense_layers=dense_layers)


def uses_sparse_prefill(attention_config: AttentionConfig) -> bool:
    """True when the backend, or a per-KV-cache-group backend, is SPARSE_PREFILL."""
    backends = [attention_config.backend, *attention_config.backend_per_kind.values()]
    return any(getattr(backend, "name", None) == BACKEND_NAME for backend in backends)


def check_sparse_prefill_flags(attention_config: AttentionConfig, logger) -> SparsePrefillSettings | None:
    """Startup check: with the SPARSE_PREFILL backend, validate the flags and log the effective values
    once; without it, warn about flags that were changed (they have no effect)."""
    if not uses_sparse_prefill(attention_config):
        changed = [
            flag(name) for name in SPARSE_PREFILL_FIELDS if getattr(attention_config, name) != getattr(AttentionConfig, name)
        ]
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
