"""The ``--sparse-prefill-*`` flags of the SPARSE_PREFILL backend on vLLM 0.6.3 (V0): CLI and startup check.

Placed by the prefill-accel overlay. The flags, names and defaults are those of the vLLM 0.26.0 series;
vLLM 0.6.3 selects attention backends with ``VLLM_ATTENTION_BACKEND``, so the backend is chosen with
``VLLM_ATTENTION_BACKEND=SPARSE_PREFILL`` and tuned with these flags. At engine creation the values
are validated by the runtime (``prefill_accel.flags``: every error names the flag), logged once, and
handed to the attention layers through the cache config; without the backend, changed flags draw a
warning (they have no effect).
"""

import argparse
import os
from typing import Optional

from prefill_accel.flags import (BACKEND_NAME, FIELD_PREFIX, SUFFIXES,
                                 SparsePrefillSettings, changed_flags, flag,
                                 settings_from_flags)

HELP = {
    "threshold": "Keep a key block whose estimated attention share is at least "
    "this times the largest of its query block; 0 keeps every causal block "
    "(exact dense attention).",
    "target_mass": "Above 0, also keep the fewest highest-estimate blocks "
    "holding this share of the estimated attention.",
    "min_len": "Prefill chunks with at least this many query tokens use "
    "block-sparse attention; shorter ones and decodes use FlashAttention.",
    "dense_layers": "The first N decoder layers always use FlashAttention.",
    "block_size": "Positions per query and key block of the sparse kernel "
    "(64, 128 or 256).",
    "sink_blocks": "First key blocks always kept (attention sinks).",
    "local_blocks": "Key blocks just before the diagonal always kept.",
    "last_query_blocks": "The last query blocks of a sequence are computed "
    "dense.",
    "query_stride": "The block search scores every n-th query row of a "
    "block.",
    "estimator": "Block-importance estimate of the search: pooled (mean "
    "keys), bound (key bounds), mixed (the mean of those two) or exact (the "
    "exact attention of a few query rows per block).",
    "exact_rows": "Query rows per block of the exact estimator (1, 2, 4 or "
    "8).",
    "mean_correction": "Pruned blocks before the diagonal contribute "
    "through their mean key and value.",
}


def add_sparse_prefill_flags(parser: argparse.ArgumentParser,
                             defaults: object) -> None:
    """Add ``--sparse-prefill-*`` with the defaults of ``defaults``'s ``sparse_prefill_*`` fields."""
    for suffix in SUFFIXES:
        default = getattr(defaults, FIELD_PREFIX + suffix)
        if isinstance(default, bool):
            parser.add_argument(flag(suffix),
                                action="store_true",
                                help=HELP[suffix])
        else:
            parser.add_argument(flag(suffix),
                                type=type(default),
                                default=default,
                                help=HELP[suffix])


def backend_selected() -> bool:
    return os.environ.get("VLLM_ATTENTION_BACKEND") == BACKEND_NAME


def check_sparse_prefill_flags(engine_args: object,
                               logger) -> Optional[SparsePrefillSettings]:
    """Validate and log the settings when the backend is selected; else warn about changed flags."""
    values = {
        suffix: getattr(engine_args, FIELD_PREFIX + suffix)
        for suffix in SUFFIXES
    }
    if not backend_selected():
        changed = changed_flags(values)
        if changed:
            logger.warning(
                "%s set but the attention backend is not %s; they only "
                "apply with VLLM_ATTENTION_BACKEND=%s", ", ".join(changed),
                BACKEND_NAME, BACKEND_NAME)
        return None
    settings = settings_from_flags(values)
    logger.info(
        "%s attention: prefill chunks of >= %d tokens use block-sparse "
        "attention (%s); decodes and shorter chunks use FlashAttention",
        BACKEND_NAME, settings.kernel.min_q_len, settings.describe())
    return settings
