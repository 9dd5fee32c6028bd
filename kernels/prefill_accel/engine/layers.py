"""Which attention layers the sparse path may take, decided once for every engine.

An adapter reads a layer's traits off the engine's layer (its attention implementation, its index)
into LayerTraits; dense_reason says why the layer stays dense on every step, or None when its long
prefill chunks may go sparse. The reasons are kernels that cannot run in the process, what the kernel
cannot compute (it is causal softmax attention over a plain paged cache of one head size), and the
layers the user keeps dense.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SUPPORTED_HEAD_DIMS
from ..flags import SparsePrefillSettings, flag
from .startup import kernels_unavailable


@dataclass(frozen=True)
class LayerTraits:
    """What decides a layer, in the kernel's terms; the defaults are the plain causal decoder layer."""

    head_size: int
    index: int | None = None
    """The layer's position in the model, where the engine gives one."""
    name: str = ""
    """The engine's name of the layer, for messages."""
    attention_type: str | None = None
    """None for causal self-attention; otherwise what the engine calls the layer's attention."""
    sliding_window: int | None = None
    """Tokens a query sees, where the layer has a window."""
    chunked_local: bool = False
    alibi: bool = False
    soft_cap: bool = False
    sinks: bool = False
    quantized_kv: str | None = None
    """How the KV cache is quantized (its dtype), or None for a cache in the activations' dtype."""
    v_head_size: int | None = None
    """Where V's head size differs from K's."""
    context_parallel: bool = False


def dense_reason(traits: LayerTraits, settings: SparsePrefillSettings | None) -> str | None:
    """Why every step of the layer stays dense, or None when its long prefill chunks may go sparse."""
    if settings is None:
        return "no settings (engine created without the flags check)"
    missing = kernels_unavailable()
    if missing is not None:
        return missing
    if traits.attention_type is not None:
        return f"attention type {traits.attention_type} (the kernel computes causal self-attention)"
    for present, reason in (
        (traits.sliding_window is not None, f"sliding window of {traits.sliding_window}"),
        (traits.chunked_local, "chunked local attention (iRoPE)"),
        (traits.alibi, "ALiBi"),
        (traits.soft_cap, "logit soft-capping"),
        (traits.sinks, "attention sinks"),
        (traits.quantized_kv is not None, f"KV cache dtype {traits.quantized_kv}"),
        (traits.context_parallel, "decode context parallelism"),
        (traits.v_head_size not in (None, traits.head_size), f"K head size {traits.head_size} != V head size {traits.v_head_size}"),
        (traits.head_size not in SUPPORTED_HEAD_DIMS, f"head size {traits.head_size} (the kernel has {SUPPORTED_HEAD_DIMS})"),
    ):  # fmt: skip
        if present:
            return reason
    if settings.dense_layers:
        if traits.index is None:
            return f"no layer index in {traits.name!r}"
        if traits.index < settings.dense_layers:
            return f"layer {traits.index} < {flag('dense_layers')}={settings.dense_layers}"
    return None
