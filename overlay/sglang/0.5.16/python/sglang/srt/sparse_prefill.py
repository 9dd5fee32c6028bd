"""The ``--sparse-prefill-*`` flags of SGLang's ``sparse_prefill`` prefill attention backend: startup check.

Placed by the prefill-accel overlay. The flags, names, defaults and meanings are those of the vLLM
series (``prefill_accel.flags``); ServerArgs declares them with default_value()'s defaults and calls
check_sparse_prefill_flags() while it validates its arguments. The backend itself is chosen with
``--prefill-attention-backend sparse_prefill``: it computes extend (prefill) batches only, and
hands short extends, the dense layers and decodes to a dense backend.
"""

from typing import Optional

from prefill_accel.flags import (
    BACKEND_NAME,
    FIELD_PREFIX,
    SUFFIXES,
    SparsePrefillSettings,
    changed_flags,
    default_value,  # noqa: F401  (ServerArgs takes its field defaults from here)
    settings_from_flags,
)

BACKEND = BACKEND_NAME.lower()
# ServerArgs fields that must not name the backend: it has no decode path of its own.
DENSE_ONLY_ARGS = ("attention_backend", "decode_attention_backend")


def flag_values(server_args) -> dict:
    """The ``sparse_prefill_*`` ServerArgs values, keyed by flag suffix."""
    return {suffix: getattr(server_args, FIELD_PREFIX + suffix) for suffix in SUFFIXES}


def settings_from_server_args(server_args) -> SparsePrefillSettings:
    return settings_from_flags(flag_values(server_args))


def check_sparse_prefill_flags(server_args, logger) -> Optional[SparsePrefillSettings]:
    """Validate and log the settings when the backend is selected; else warn about changed flags."""
    for name in DENSE_ONLY_ARGS:
        if getattr(server_args, name) == BACKEND:
            raise ValueError(
                f"--{name.replace('_', '-')} {BACKEND}: the {BACKEND} backend computes prefills only; "
                f"select it with --prefill-attention-backend {BACKEND} and keep a dense backend "
                "(e.g. fa3, flashinfer, triton) in --attention-backend or --decode-attention-backend"
            )
    values = flag_values(server_args)
    if server_args.prefill_attention_backend != BACKEND:
        changed = changed_flags(values)
        if changed:
            logger.warning(
                "%s set but the prefill attention backend is not %s; they only apply with "
                "--prefill-attention-backend %s",
                ", ".join(changed), BACKEND, BACKEND,
            )
        return None
    settings = settings_from_flags(values)
    logger.info(
        "%s prefill attention: extend batches holding a request of >= %d new tokens use block-sparse "
        "attention (%s); shorter extends and decodes use the dense backend",
        BACKEND, settings.kernel.min_q_len, settings.describe(),
    )
    return settings
