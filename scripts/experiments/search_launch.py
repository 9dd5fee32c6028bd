#!/usr/bin/env python3
"""The block search's cost by estimator and launch shape (32 / 8 heads, head_dim 128, bf16): the whole
search (pooling + search kernel) for each key-tile width and warp count, and, with --old, the same
search of an earlier copy of the package side by side, with how far their indices differ.

  python3 scripts/experiments/search_launch.py [--old DIR]   (DIR: an earlier kernels/prefill_accel)
"""

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
import bench_kernels  # noqa: E402
from prefill_accel import BatchLayout, SparsePrefillConfig, triton_kernels  # noqa: E402

# The launch shapes timed beside the default ({}); docs/results/bench/search-launch-h200-2026-12-01.md has them all.
VARIANTS = [{}] + [{"num_warps": warps, "BLOCK_J": tile} for warps in (2, 4, 8) for tile in (32, 64, 128)]


def load_package(path: Path, name: str):
    """Import the package at ``path`` under ``name`` (its imports are relative, so it keeps to itself)."""
    spec = importlib.util.spec_from_file_location(name, path / "__init__.py", submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    importlib.import_module(name + ".triton_kernels")  # the package imports it on first use only
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--old", type=Path, help="an earlier copy of kernels/prefill_accel to time beside this one")
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--threshold", type=float, default=0.004)
    parser.add_argument("--estimators", default="pooled,bound,mixed",
                        help="searches to time; name/N scores every N-th query row (mixed/8)")
    args = parser.parse_args()
    old = load_package(args.old, "prefill_accel_old") if args.old else None
    print("| N | estimator | launch | search ms | pooling ms | vs default |\n|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        q, k, v = bench_kernels.structured_qkv(length, 32, 8, 128, 128, torch.bfloat16, seed=length)
        k_cache, _, table = bench_kernels.paged(k, v, 16)
        cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
        seqlens = torch.tensor([length], dtype=torch.int32, device="cuda")
        host = (torch.tensor([0, length]), torch.tensor([length]))
        for spec in args.estimators.split(","):
            config = bench_kernels.estimator_config(spec, SparsePrefillConfig.query_stride, min_q_len=0,
                                                    threshold=args.threshold)  # fmt: skip
            estimator = config.estimator
            layout = BatchLayout.build(*host, config, q.device)
            search_args = (q, k_cache, table, cu, seqlens, layout, config, 128**-0.5)
            means, bounds = estimator != "bound", estimator != "pooled"
            pool = lambda: triton_kernels.pool_blocks(k_cache, table, seqlens, layout, means, bounds, q.dtype)  # noqa: B023, E731
            pool_ms = bench_kernels.cuda_time(pool, 7)
            base = None
            for launch in VARIANTS:
                try:
                    run = lambda: triton_kernels.select_blocks(*search_args, launch=launch)  # noqa: B023, E731
                    ms = bench_kernels.cuda_time(run, 7)
                except Exception as error:  # a tile past the shared memory
                    print(f"| {length // 1024}K | {spec} | {launch} | {str(error).splitlines()[0][:80]} | | |")
                    continue
                base = base or ms
                print(f"| {length // 1024}K | {spec} | {launch or 'default'} | {ms:.2f} | {pool_ms:.2f} | {ms / base:.2f} |", flush=True)
            if old is not None:
                old_config = old.SparsePrefillConfig(min_q_len=0, estimator=estimator, threshold=args.threshold,
                                                     query_stride=config.query_stride)  # fmt: skip
                old_layout = old.BatchLayout.build(*host, old_config, q.device)
                old_args = (q, k_cache, table, cu, seqlens, old_layout, old_config, 128**-0.5)
                ms = bench_kernels.cuda_time(lambda: old.triton_kernels.select_blocks(*old_args), 7)  # noqa: B023
                new_index = triton_kernels.select_blocks(*search_args)
                old_index = old.triton_kernels.select_blocks(*old_args)
                score_diff = (new_index.scores - old_index.scores).abs().max().item()
                mask_diff = (new_index.to_mask() != old_index.to_mask()).float().mean().item()
                print(f"| {length // 1024}K | {spec} | earlier copy | {ms:.2f} | | {ms / base:.2f} "
                      f"(scores within {score_diff:.1e}, masks differ in {mask_diff:.1e}) |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
