"""Real-weight accuracy harness: block-sparse prefill measured against dense attention on GGUF models.

Run ``python -m prefill_accel.accuracy --help``; see ``docs/accuracy-harness.md``. Needs the
``accuracy`` extra (transformers, gguf, accelerate).
"""

from .attention import AttentionRun, register, sparse_attention, use
from .harness import ConfigResult, Harness, capture_qkv
from .metrics import block_attention_mass, kl_divergence, relative_error, selection_quality
from .models import MODELS, fetch_gguf, load_model, sparse_layer_ids
from .needle import build_prompt, build_prompts, parse_answer

__all__ = [
    "MODELS",
    "AttentionRun",
    "ConfigResult",
    "Harness",
    "block_attention_mass",
    "build_prompt",
    "build_prompts",
    "capture_qkv",
    "fetch_gguf",
    "kl_divergence",
    "load_model",
    "parse_answer",
    "register",
    "relative_error",
    "selection_quality",
    "sparse_attention",
    "sparse_layer_ids",
    "use",
]
