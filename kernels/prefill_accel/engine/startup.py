"""The startup check of the --sparse-prefill-* flags, the same on every engine: with the backend
selected, validate them and log the effective values once; without it, warn when they were changed,
since they then do nothing.

An adapter gives the flag values (keyed by suffix), whether the backend is selected, and an
EngineFacts saying how the engine is configured; it applies nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..flags import SparsePrefillSettings, changed_flags, help_text, settings_from_flags


@dataclass(frozen=True)
class EngineFacts:
    """How an engine selects and describes the backend, in its own words."""

    backend: str
    """The backend's name on this engine (``SPARSE_PREFILL``, ``sparse_prefill``)."""
    selector: str
    """What the engine calls the setting that picks it (``attention backend``, ``prefill attention backend``)."""
    select_hint: str
    """How a user selects it (``--attention-backend SPARSE_PREFILL``)."""
    dense: str
    """The engine's dense path, where shorter chunks and decodes go (``FlashAttention``)."""
    sparse_unit: str = "prefill chunks"
    """What the minimum length applies to, as the engine batches it."""
    dense_rest: str = "decodes and shorter chunks"
    """What goes to the dense path, as the startup line says it."""

    def help(self, suffix: str) -> str:
        return help_text(suffix, self.backend, self.dense)


def check_flags(values: dict[str, object], selected: bool, facts: EngineFacts, logger,
                chosen: str | None = None) -> SparsePrefillSettings | None:  # fmt: skip
    """The settings the backend runs with (validated: a bad value raises ValueError naming its flag),
    logged as one INFO line; None without the backend, with one WARNING naming changed flags.
    ``chosen`` is the backend the engine picked instead, where it says."""
    if not selected:
        changed = changed_flags(values)
        if changed:
            logger.warning("%s set but the %s is %s; they only apply with %s", ", ".join(changed), facts.selector,
                           chosen or f"not {facts.backend}", facts.select_hint)  # fmt: skip
        return None
    settings = settings_from_flags(values)
    logger.info("%s attention: %s of >= %d tokens use block-sparse attention (%s); %s use %s", facts.backend,
                facts.sparse_unit, settings.kernel.min_q_len, settings.describe(), facts.dense_rest, facts.dense)
    return settings
