"""The accuracy sweep: for each prompt length and sparse configuration, the metrics of one model."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from ..config import SparsePrefillConfig
from ..corpus import stdlib_sources
from .attention import AttentionRun, use
from .metrics import kl_divergence
from .models import load_model, sparse_layer_ids
from .needle import build_prompts, parse_answer

LOGIT_CHUNK_ROWS = 1024
"""Prompt positions whose full-vocabulary logits exist at once when computing KL."""


def natural_text_ids(tokenizer, length: int, text: str | None = None) -> list[int]:
    """``length`` token ids of ``text`` (default: the standard library sources of
    :func:`prefill_accel.corpus.stdlib_sources`, its fixed module list first)."""
    parts = [text] if text is not None else []
    sources = stdlib_sources()
    while True:
        ids = tokenizer("\n\n".join(parts)).input_ids
        if len(ids) >= length:
            return ids[:length]
        source = next(sources, None)
        if source is None:
            raise ValueError(f"the prompt text has only {len(ids)} tokens, fewer than the requested {length}")
        parts.append(source)


@dataclass
class ConfigResult:
    """The metrics of one (length, configuration) pair; the fields of the printed table and the JSON."""

    length: int
    config: dict
    density: float
    """Kept over causal blocks over all sparse layers and KV heads, in the sparse forward."""
    kl: float
    """Mean over prompt positions of KL(dense || sparse) of the next-token distribution."""
    kl_max: float
    rel_err_mean: float
    rel_err_max: float
    recall: float | None
    oracle_density: float | None
    oracle_density_95: float | None
    analysed_density: float | None
    """Density over the analysed layers only, the one to set beside the oracle densities."""
    needle_dense: float | None
    needle_sparse: float | None
    layers: list[dict] = field(default_factory=list)
    needles: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def final_hidden(model, input_ids: torch.Tensor) -> torch.Tensor:
    """(L, hidden) last-layer hidden states of a prompt (logits are formed later, in chunks)."""
    with torch.no_grad():
        return model.model(input_ids=input_ids, use_cache=False).last_hidden_state[0]


def logits_from_hidden(model, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(hidden).float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


@torch.no_grad()
def mean_kl(model, dense_hidden: torch.Tensor, sparse_hidden: torch.Tensor) -> tuple[float, float]:
    """Mean and max over positions of KL(dense || sparse) of the next-token distributions."""
    total, worst = 0.0, 0.0
    for start in range(0, dense_hidden.shape[0], LOGIT_CHUNK_ROWS):
        rows = slice(start, start + LOGIT_CHUNK_ROWS)
        dense, sparse = (logits_from_hidden(model, h[rows]) for h in (dense_hidden, sparse_hidden))
        kl = kl_divergence(dense, sparse)
        total += float(kl.sum())
        worst = max(worst, float(kl.max()))
    return total / dense_hidden.shape[0], worst


def greedy_answer(model, tokenizer, input_ids: list[int], max_new_tokens: int) -> str:
    ids = torch.tensor([input_ids], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def needle_accuracy(model, tokenizer, prompts, run: AttentionRun, max_new_tokens: int) -> tuple[float, list[dict]]:
    rows = []
    for prompt in prompts:
        with use(run):
            text = greedy_answer(model, tokenizer, prompt.input_ids, max_new_tokens)
        rows.append(
            {"depth": prompt.depth, "key": prompt.key, "value": prompt.value, "tokens": len(prompt.input_ids),
             "output": text, "correct": parse_answer(text) == prompt.value}  # fmt: skip
        )
    return sum(r["correct"] for r in rows) / max(len(rows), 1), rows


@dataclass
class Harness:
    """A loaded model and the options that stay fixed across a sweep."""

    model: object
    tokenizer: object
    backend: str = "reference"
    page_size: int = 16
    analysis_layers: list[int] | None = None
    """Layers whose selection quality is measured; None measures every sparse layer."""
    needle_depths: list[float] = field(default_factory=list)
    needle_tokens: int = 12
    text: str | None = None
    seed: int = 0
    _cache: dict = field(default_factory=dict)
    _masses: dict = field(default_factory=dict)

    @classmethod
    def load(cls, model_name=None, gguf=None, device="cpu", dtype=torch.float32, cache_dir=None, rope_scaling=None,
             **options):
        model, tokenizer = load_model(model_name, gguf, device, dtype, cache_dir, rope_scaling)
        return cls(model, tokenizer, **options)

    @property
    def sparse_layers(self) -> list[int]:
        return sparse_layer_ids(self.model)

    def _run(self, mode: str, config: SparsePrefillConfig, **extra) -> AttentionRun:
        return AttentionRun(
            mode=mode, config=config, backend=self.backend, page_size=self.page_size,
            sparse_layers=frozenset(self.sparse_layers), **extra,
        )  # fmt: skip

    def _dense(self, length: int):
        """Per length, computed once: prompt ids, dense final hidden states, needle prompts and dense needle results."""
        if length not in self._cache:
            ids = torch.tensor([natural_text_ids(self.tokenizer, length, self.text)], device=self.model.device)
            with use(self._run("dense", SparsePrefillConfig())):
                hidden = final_hidden(self.model, ids)
            prompts = build_prompts(self.tokenizer, length, self.needle_depths, self.seed) if self.needle_depths else []
            dense_needles = None
            if prompts:
                dense_needles = needle_accuracy(
                    self.model, self.tokenizer, prompts, self._run("dense", SparsePrefillConfig()), self.needle_tokens
                )
            self._cache[length] = (ids, hidden, prompts, dense_needles)
        return self._cache[length]

    @torch.no_grad()
    def evaluate(self, length: int, config: SparsePrefillConfig) -> ConfigResult:
        """Every metric of one configuration at one prompt length."""
        started = time.perf_counter()
        ids, dense_hidden, prompts, dense_needles = self._dense(length)
        analysis = self.sparse_layers if self.analysis_layers is None else self.analysis_layers
        compare = self._run("compare", config, analysis_layers=frozenset(analysis), masses=self._masses)
        with use(compare):
            final_hidden(self.model, ids)
        sparse = self._run("sparse", config)
        with use(sparse):
            sparse_hidden = final_hidden(self.model, ids)
        kl, kl_max = mean_kl(self.model, dense_hidden, sparse_hidden)
        analysed = [r for r in compare.records if r.recall is not None]
        mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
        needle_sparse, needle_rows = None, []
        if prompts:
            needle_sparse, sparse_rows = needle_accuracy(
                self.model, self.tokenizer, prompts, self._run("sparse", config), self.needle_tokens
            )
            needle_rows = [
                {**d, "sparse_output": s["output"], "sparse_correct": s["correct"]}
                for d, s in zip(dense_needles[1], sparse_rows)
            ]
        rel_errs = [r.rel_err for r in compare.records]
        return ConfigResult(
            length=length,
            config=asdict(config),
            density=sparse.density,
            kl=kl,
            kl_max=kl_max,
            rel_err_mean=mean(rel_errs) if rel_errs else math.nan,
            rel_err_max=max(rel_errs, default=math.nan),
            recall=mean([r.recall for r in analysed]),
            oracle_density=mean([r.oracle_density for r in analysed]),
            oracle_density_95=mean([r.oracle_density_95 for r in analysed]),
            analysed_density=mean([r.density for r in analysed]),
            needle_dense=dense_needles[0] if dense_needles else None,
            needle_sparse=needle_sparse,
            layers=[asdict(r) for r in compare.records],
            needles=needle_rows,
            seconds=time.perf_counter() - started,
        )


def capture_qkv(
    model_name: str | None = None,
    length: int = 8192,
    layers: list[int] | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    gguf=None,
    cache_dir=None,
    text: str | None = None,
    harness: Harness | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """Post-RoPE q, k, v of full-attention layers for a natural-text prompt of ``length`` tokens.

    Returns ``{layer: {"q": (L, Hq, D), "k": (L, Hkv, D), "v": (L, Hkv, D)}}`` in bfloat16 on the CPU:
    exactly the tensors the attention function receives. ``layers`` defaults to every full-attention
    layer; pass ``harness`` to reuse a loaded model.
    """
    if harness is None:
        dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        harness = Harness.load(model_name, gguf, device, dtype, cache_dir, text=text)
    chosen = harness.sparse_layers if layers is None else list(layers)
    missing = sorted(set(chosen) - set(harness.sparse_layers))
    if missing:
        raise ValueError(f"layers {missing} are not full-attention layers; choose from {harness.sparse_layers}")
    ids = torch.tensor([natural_text_ids(harness.tokenizer, length, harness.text)], device=harness.model.device)
    run = harness._run("capture", SparsePrefillConfig(), capture_layers=frozenset(chosen))
    with use(run):
        final_hidden(harness.model, ids)
    return run.captured
