"""The ``--sparse-prefill-*`` engine flags, shared by every engine integration.

Each engine declares the same flags (``--sparse-prefill-threshold``, ``--sparse-prefill-min-len``,
...) in its own configuration; this module turns their values, keyed by suffix (``threshold``,
``min_len``, ...), into :class:`SparsePrefillSettings` (the kernel's :class:`SparsePrefillConfig`
plus the layers kept dense), validating them with errors that name the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import SparsePrefillConfig

BACKEND_NAME = "SPARSE_PREFILL"
FIELD_PREFIX = "sparse_prefill_"
# Flag suffix -> SparsePrefillConfig field, where the flag reads better than the kernel name.
KERNEL_FIELD = {"min_len": "min_q_len"}
# Suffixes in the order of --help; `dense_layers` is the engine's, the others the kernel's.
SUFFIXES = (
    "threshold", "target_mass", "min_len", "dense_layers", "block_size", "sink_blocks", "local_blocks",
    "last_query_blocks", "query_stride", "estimator", "exact_rows", "mean_correction",
)  # fmt: skip


# The help of every flag, written once: each engine's --help shows these (vLLM 0.26's AttentionConfig
# docstrings are checked against them by its adapter's test). {dense} is the engine's dense path.
HELP = {
    "threshold": "keep a key block whose estimated attention share is at least this times the largest of its "
                 "query block, in [0, 1]; 0 keeps every causal block (exact dense attention)",
    "target_mass": "above 0, a query block also keeps its highest-estimate key blocks until they hold this share "
                   "of its estimated attention (a mass-targeted cut); 0 disables it",
    "min_len": "a prefill chunk uses block-sparse attention once its sequence holds this many tokens and the "
               "chunk brings at least the attention work of a fresh prompt half as long (a fresh prompt of this "
               "length, every chunk of a longer one from that context on); other chunks dense attention, decodes "
               "{dense}; at least --sparse-prefill-block-size",
    "dense_layers": "the first N attention layers always use {dense}",
    "block_size": "positions per query block and key block of the block-sparse search (64, 128 or 256)",
    "sink_blocks": "key blocks at the start of the sequence that every query block keeps (attention sinks)",
    "local_blocks": "key blocks just before the diagonal that every query block keeps (local window)",
    "last_query_blocks": "the last query blocks of each prompt are computed dense (they shape the first "
                         "generated token)",
    "query_stride": "the block search scores every N-th query row of a block (1 scores all rows); must divide "
                    "the block size",
    "estimator": "how the block search estimates a key block's share of attention: pooled (sampled query rows "
                 "against each block's mean key), bound (against its key bounds), mixed (the mean of the two) or "
                 "exact (the exact attention of a few query rows per block)",
    "exact_rows": "query rows per block of the exact estimator (1, 2, 4 or 8)",
    "mean_correction": "pruned key blocks fully visible to a query block still contribute through their mean "
                       "key and value",
}  # fmt: skip


def help_text(suffix: str, backend: str, dense: str) -> str:
    """The --help of one flag on an engine: ``backend`` names the backend it tunes, ``dense`` the
    engine's dense path (``FlashAttention``, ``the dense backend``)."""
    return f"{backend} backend: {HELP[suffix].format(dense=dense)}."


def flag(name: str) -> str:
    """``sparse_prefill_min_len`` or ``min_len`` -> ``--sparse-prefill-min-len``."""
    return "--" + (FIELD_PREFIX + name.removeprefix(FIELD_PREFIX)).replace("_", "-")


def kernel_field(suffix: str) -> str:
    """The SparsePrefillConfig field a flag sets: ``min_len`` -> ``min_q_len``, ``threshold`` -> ``threshold``."""
    return KERNEL_FIELD.get(suffix, suffix)


def default_value(suffix: str):
    """The flag's default: the kernel's default, 0 dense layers."""
    return 0 if suffix == "dense_layers" else getattr(SparsePrefillConfig(), kernel_field(suffix))


@dataclass(frozen=True)
class SparsePrefillSettings:
    """What an engine's backend runs with: the kernel's configuration and the layers kept dense."""

    kernel: SparsePrefillConfig
    dense_layers: int

    def describe(self) -> str:
        """The effective value of every flag, as ``--flag=value`` in the order of ``--help``."""
        values = []
        for suffix in SUFFIXES:
            value = self.dense_layers if suffix == "dense_layers" else getattr(self.kernel, kernel_field(suffix))
            values.append(f"{flag(suffix)}={value}")
        return " ".join(values)


def settings_from_flags(values: dict[str, object]) -> SparsePrefillSettings:
    """Validate the flag values (keyed by suffix; missing ones take their defaults) and build the
    settings; every error names the flag to change."""
    unknown = set(values) - set(SUFFIXES)
    if unknown:
        raise ValueError(f"unknown sparse prefill flag(s): {', '.join(flag(s) for s in sorted(unknown))}")
    values = {suffix: values.get(suffix, default_value(suffix)) for suffix in SUFFIXES}
    dense_layers = values.pop("dense_layers")
    if isinstance(dense_layers, bool) or not isinstance(dense_layers, int) or dense_layers < 0:
        raise ValueError(f"{flag('dense_layers')} must be an int >= 0, got {dense_layers!r}")
    try:
        kernel = SparsePrefillConfig(**{kernel_field(name): value for name, value in values.items()})
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


def changed_flags(values: dict[str, object]) -> list[str]:
    """The flags whose values differ from their defaults (to warn when the backend is not in use)."""
    return [flag(suffix) for suffix in SUFFIXES if suffix in values and values[suffix] != default_value(suffix)]

