"""prefill-accel adapter: the ``--sparse-prefill-*`` flags of the SPARSE_PREFILL backend on vLLM 0.6.3 (V0).

Placed by the prefill-accel overlay. The flags, names, defaults and help are the runtime's
(``prefill_accel.flags``), as on the other engines; vLLM 0.6.3 selects attention backends with
``VLLM_ATTENTION_BACKEND``, so the backend is chosen with ``VLLM_ATTENTION_BACKEND=SPARSE_PREFILL`` and
tuned with these flags. At engine creation the runtime's startup check validates and logs them
(``prefill_accel.engine.startup``), and once the scheduler config is resolved it warns when its
settings leave the backend inert; the settings reach the attention layers through the cache config, and
the model loader names the layers once the model is built.
"""

import argparse
import os
from typing import List, Optional

from prefill_accel.engine.startup import (ChunkLimit, EngineFacts,
                                          check_flags, check_schedule)
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


def schedule_limits(settings: SparsePrefillSettings,
                    scheduler_config: object) -> List[ChunkLimit]:
    """What bounds one request's prefill tokens in a V0 step. Without chunked
    prefill V0 computes prefills from the step's own K/V, not the paged cache,
    so none reaches the backend; with it, the step's token budget, the model
    length and the chunk cap of long prefills."""
    if not scheduler_config.chunked_prefill_enabled:
        return [
            ChunkLimit("chunked prefill off",
                       0,
                       fix="--enable-chunked-prefill --max-num-batched-tokens "
                       f"{settings.kernel.min_q_len}")
        ]
    limits = [
        ChunkLimit("--max-num-batched-tokens",
                   scheduler_config.max_num_batched_tokens),
        ChunkLimit("--max-model-len",
                   scheduler_config.max_model_len,
                   fix="a longer --max-model-len"),
    ]
    if scheduler_config.long_prefill_token_threshold > 0:
        limits.append(
            ChunkLimit("--long-prefill-token-threshold",
                       scheduler_config.long_prefill_token_threshold))
    return limits


def check_sparse_prefill_schedule(settings: Optional[SparsePrefillSettings],
                                  scheduler_config: object,
                                  logger) -> Optional[str]:
    """The runtime's check that the resolved scheduler settings let a prefill
    chunk reach the minimum attention work within the model length; one
    warning naming the setting when they do not."""
    limits = [] if settings is None else schedule_limits(
        settings, scheduler_config)
    return check_schedule(settings, limits, FACTS, logger,
                          max_context=scheduler_config.max_model_len)


def name_sparse_prefill_layers(model: object) -> int:
    """Give every SPARSE_PREFILL layer of a built model that has no name its module path, which
    carries its index (``model.layers.7.self_attn.attn``) for --sparse-prefill-dense-layers: V0's
    model files mostly build Attention without a prefix. The runtime then decides the layer again.
    Returns how many layers were named."""
    named = 0
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        if getattr(impl, "layer_name", None) == "":
            impl.configure_sparse_prefill(impl.settings, name)
            named += 1
    return named
