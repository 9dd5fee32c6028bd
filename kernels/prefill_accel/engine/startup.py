"""The startup checks of the backend, the same on every engine: with the backend selected, validate
the --sparse-prefill-* flags and log the effective values once, and say when the kernels cannot run in
this process; without it, warn when the flags were changed, since they then do nothing. Once the
engine's scheduler settings are known, warn when they cannot produce a prefill chunk with the minimum
attention work at any context the engine holds, since the backend then never runs.

An adapter gives the flag values (keyed by suffix), whether the backend is selected, an EngineFacts
saying how the engine is configured and, for the schedule, the ChunkLimits its settings impose; it
applies nothing itself.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

from ..flags import SparsePrefillSettings, changed_flags, flag, help_text, settings_from_flags

KERNELS_NEED_TRITON = "3.0"
"""The oldest Triton the kernels run with: 3.0, the one torch 2.4 (vLLM 0.6.3) pins, compiles them all
for sm_90 (scripts/compile_check.py) and runs them in its interpreter. Their TMA reads need tensor
descriptors (Triton >= 3.4, ops.common.TMA_NEEDS_TRITON); under an older Triton every K/V tile is
read through the page table, which the startup line says."""


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
    logger.info("%s attention: %s of >= %d tokens, or as much attention work after a prefix, use block-sparse "
                "attention (%s); %s use %s", facts.backend,
                facts.sparse_unit, settings.kernel.min_q_len, settings.describe(), facts.dense_rest, facts.dense)
    missing = kernels_unavailable()
    if missing is not None:
        logger.warning("%s cannot run its kernels here: %s; every layer uses %s", facts.backend, missing, facts.dense)
    elif (limit := kernels_without_tma()) is not None:
        logger.info("%s: %s", facts.backend, limit)
    return settings


@functools.cache
def kernels_unavailable() -> str | None:
    """Why the Triton kernels cannot run in this process, or None. Only a CUDA process runs them (on
    other devices the package computes with its PyTorch reference), so without a CUDA device this is
    None; with one, the kernel modules are imported (not compiled) once to find out."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        for module in ("attention", "search", "staging"):
            importlib.import_module(f"..ops.{module}", __package__)
    except ImportError as error:
        try:
            import triton

            found = f"triton {triton.__version__}"
        except ImportError:
            found = "no triton"
        return f"its Triton kernels do not import with {found} ({error}); they need triton >= {KERNELS_NEED_TRITON}"
    return None


@functools.cache
def kernels_without_tma() -> str | None:
    """What the kernels do without bulk tensor copies on a GPU that has them (compute capability 9.0
    and later) under a Triton without tensor descriptors; None where that does not apply."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return None
    import triton

    from ..ops import common

    if common.TENSOR_DESCRIPTORS:
        return None
    return (f"triton {triton.__version__} has no tensor descriptors (triton >= {common.TMA_NEEDS_TRITON}): "
            "the kernels read K/V tiles through the page table, not with TMA bulk copies")  # fmt: skip


@dataclass(frozen=True)
class ChunkLimit:
    """One engine setting that bounds how many prefill tokens of one request a step can hold."""

    setting: str
    """The setting as a user writes it (``--max-num-batched-tokens``)."""
    tokens: int
    """The bound it sets; 0 when, so set, no prefill chunk reaches the backend's path at all."""
    fix: str = ""
    """What to set instead, in the engine's words; empty: the setting itself, at the minimum length."""


def binding_limit(limits: list[ChunkLimit]) -> ChunkLimit | None:
    """The limit that sets the longest prefill chunk a step can hold (the tightest); None without limits."""
    return min(limits, key=lambda limit: limit.tokens, default=None)


def inert_reason(settings: SparsePrefillSettings, limits: list[ChunkLimit], max_context: int | None = None) -> str | None:
    """Why no prefill chunk can take the sparse path under ``limits``, naming the setting that binds
    and what to change; None when the longest chunk they allow reaches the sparse path's work
    (SparsePrefillConfig.long_chunk) at some context up to ``max_context``, the longest sequence the
    engine holds (None: any)."""
    binding = binding_limit(limits)
    if binding is None:
        return None
    reach = settings.kernel.sparse_from(binding.tokens)
    if reach is not None and (max_context is None or reach <= max_context):
        return None
    minimum = settings.kernel.min_q_len
    fix = binding.fix or f"{binding.setting} {minimum}"
    if binding.tokens == 0:
        held = "admits no prefill chunk to it"
    elif reach is None:
        held = f"caps a prefill chunk at {binding.tokens} tokens, below {flag('min_len')}={minimum}"
    else:
        held = (f"caps a prefill chunk at {binding.tokens} tokens, which takes the sparse path under "
                f"{flag('min_len')}={minimum} only from a context of {reach} tokens, beyond the {max_context} "
                "the engine holds")  # fmt: skip
    return f"{binding.setting} {held}; set {fix} (or lower {flag('min_len')}) for long prompts to take the sparse path"


def late_start(settings: SparsePrefillSettings, limits: list[ChunkLimit]) -> str | None:
    """Where the binding limit keeps chunks so short that they take the sparse path only from a context
    longer than the minimum length: from which context, said as the startup line says it; else None."""
    binding = binding_limit(limits)
    if binding is None or binding.tokens >= settings.kernel.min_q_len:
        return None
    reach = settings.kernel.sparse_from(binding.tokens)
    if reach is None or reach <= settings.kernel.min_q_len:
        return None
    return (f"{binding.setting} caps a prefill chunk at {binding.tokens} tokens, below {flag('min_len')}="
            f"{settings.kernel.min_q_len}: a chunk takes the sparse path from a context of {reach} tokens")


def check_schedule(settings: SparsePrefillSettings | None, limits: list[ChunkLimit], facts: EngineFacts,
                   logger, max_context: int | None = None) -> str | None:  # fmt: skip
    """With the backend selected (``settings`` not None), one WARNING when the scheduler settings make
    it inert up to ``max_context`` (see inert_reason): every prefill then uses the dense path; one INFO
    line when they only delay it to a longer context (late_start). Returns the inert reason."""
    if settings is None:
        return None
    reason = inert_reason(settings, limits, max_context)
    if reason is not None:
        logger.warning("%s never runs: %s; until then every prefill uses %s", facts.backend, reason, facts.dense)
        return reason
    late = late_start(settings, limits)
    if late is not None:
        logger.info("%s: %s", facts.backend, late)
    return None
