"""prefill-accel adapter: the ``--sparse-prefill-*`` flags of the SPARSE_PREFILL backend on vLLM 0.6.3 (V0).

Placed by the prefill-accel overlay. The flags, names, defaults and help are the runtime's
(``prefill_accel.flags``), as on the other engines; vLLM 0.6.3 selects attention backends with
``VLLM_ATTENTION_BACKEND``, so the backend is chosen with ``VLLM_ATTENTION_BACKEND=SPARSE_PREFILL`` and
tuned with these flags. At engine creation the runtime's startup check validates and logs them
(``prefill_accel.engine.startup``); the settings reach the attention layers through the cache config.
"""

import argparse
import os
from typing import Optional

from prefill_accel.engine.startup import EngineFacts, check_flags
from prefill_accel.flags import (BACKEND_NAME, FIELD_PREFIX, SUFFIXES,
                                 SparsePrefillSettings, flag)

FACTS = EngineFacts(backend=BACKEND_NAME,
                    selector="attention backend",
                    select_hint=f"VLLM_ATTENTION_BACKEND={BACKEND_NAME}",
                    dense="FlashAttention")


def add_sparse_prefill_flags(parser: argparse.ArgumentParser,
                             defaults: object) -> None:
    """Add ``--sparse-prefill-*`` with the defaults of ``defaults``'s ``sparse_prefill_*`` fields."""
    for suffix in SUFFIXES:
        default = getattr(defaults, FIELD_PREFIX + suffix)
        if isinstance(default, bool):
            parser.add_argument(flag(suffix),
                                action="store_true",
                                help=FACTS.help(suffix))
        else:
            parser.add_argument(flag(suffix),
                                type=type(default),
                                default=default,
                                help=FACTS.help(suffix))


def check_sparse_prefill_flags(engine_args: object,
                               logger) -> Optional[SparsePrefillSettings]:
    """The runtime's startup check of the engine arguments' flags."""
    values = {
        suffix: getattr(engine_args, FIELD_PREFIX + suffix)
        for suffix in SUFFIXES
    }
    selected = os.environ.get("VLLM_ATTENTION_BACKEND") == BACKEND_NAME
    return check_flags(values, selected, FACTS, logger)
