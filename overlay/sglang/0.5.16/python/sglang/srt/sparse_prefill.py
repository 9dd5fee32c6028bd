"""prefill-accel adapter: the ``--sparse-prefill-*`` flags of SGLang's ``sparse_prefill`` prefill attention backend.

Placed by the prefill-accel overlay. The flags, names, defaults, help and startup check are the
runtime's (``prefill_accel.flags``, ``prefill_accel.engine.startup``), as on the vLLM series; ServerArgs
declares them with default_value() and sparse_prefill_help() and calls
check_sparse_prefill_flags() while it validates its arguments, then, once every default is resolved,
check_sparse_prefill_schedule(). The backend is chosen with
``--prefill-attention-backend sparse_prefill``: it computes extend (prefill) batches only, and hands
short extends, the dense layers and decodes to a dense backend.
"""

from typing import Optional

from prefill_accel.engine.startup import ChunkLimit, EngineFacts, check_flags, check_schedule
from prefill_accel.flags import (
    BACKEND_NAME,
    FIELD_PREFIX,
    SUFFIXES,
    SparsePrefillSettings,
    default_value,  # noqa: F401  (ServerArgs takes its field defaults from here)
    settings_from_flags,
)

BACKEND = BACKEND_NAME.lower()
FACTS = EngineFacts(
    backend=BACKEND, selector="prefill attention backend", select_hint=f"--prefill-attention-backend {BACKEND}",
    dense="the dense backend", sparse_unit="extend batches holding a request", dense_rest="shorter extends and decodes",
)  # fmt: skip
# ServerArgs fields that must not name the backend: it has no decode path of its own.
DENSE_ONLY_ARGS = ("attention_backend", "decode_attention_backend")


def sparse_prefill_help(suffix: str) -> str:
    """A flag's help, for its ServerArgs field."""
    return FACTS.help(suffix)


def flag_values(server_args) -> dict:
    """The ``sparse_prefill_*`` ServerArgs values, keyed by flag suffix."""
    return {suffix: getattr(server_args, FIELD_PREFIX + suffix) for suffix in SUFFIXES}


def settings_from_server_args(server_args) -> SparsePrefillSettings:
    return settings_from_flags(flag_values(server_args))


def check_sparse_prefill_flags(server_args, logger) -> Optional[SparsePrefillSettings]:
    """Refuse the backend where it cannot decode, then the runtime's startup check."""
    for name in DENSE_ONLY_ARGS:
        if getattr(server_args, name) == BACKEND:
            raise ValueError(
                f"--{name.replace('_', '-')} {BACKEND}: the {BACKEND} backend computes prefills only; "
                f"select it with {FACTS.select_hint} and keep a dense backend "
                "(e.g. fa3, flashinfer, triton) in --attention-backend or --decode-attention-backend"
            )
    return check_flags(flag_values(server_args), server_args.prefill_attention_backend == BACKEND, FACTS, logger)


def check_sparse_prefill_schedule(server_args, logger) -> Optional[str]:
    """The runtime's check that the resolved chunk size lets an extend reach the minimum length (SGLang
    picks --chunked-prefill-size from the GPU's memory: 8192 on an H200); one warning naming it when
    it does not. Without chunking (-1) a prompt is one extend."""
    if server_args.prefill_attention_backend != BACKEND:
        return None
    size = server_args.chunked_prefill_size
    limits = [ChunkLimit("--chunked-prefill-size", size)] if size is not None and size > 0 else []
    return check_schedule(settings_from_server_args(server_args), limits, FACTS, logger,
                          max_context=server_args.context_length)
