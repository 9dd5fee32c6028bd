#!/usr/bin/env python3
"""Compare block-importance estimators on captured real q/k, against the oracle (PyTorch, CPU is fine).

For each captured layer (a .pt file from `python -m prefill_accel.accuracy --capture DIR`), every
estimator scores each (query block, KV head, key block); the max-relative cut of the kernels (plus the
always-kept sink, local and diagonal blocks) is bisected until the kept blocks hold `--recall` of the
true attention mass on average. Printed per estimator: the density kept there, and its ratio to the
oracle, both at the achieved recall row by row (as the harness reports) and at `--recall` in every row.

Estimators: the kernels' pooled keys (every `--query-stride`-th query row against each block's mean key,
as `select_blocks` does), their key bounds (the same rows against the upper bound of their logits over
each block's keys, from the elementwise largest and smallest key), Gaussian keys (not in the kernels: the pooled
estimate with each block's keys taken as independent Gaussians per dimension, which adds the block's key
variance along the row), and exact scores of a few query rows per block against every key (`exact-N`:
N evenly spaced rows, the block's last row among them).

  python scripts/compare_estimators.py CAPTURES/smollm2_L8192_layer*.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from prefill_accel.ops import search_reference  # noqa: E402
from prefill_accel.accuracy.metrics import block_attention_mass, selection_quality  # noqa: E402


def sampled_rows(block: int, pos: int, length: int, stride: int) -> torch.Tensor:
    """Rows stride-1, 2*stride-1, ... of query block ``pos`` (its last row at least)."""
    rows = torch.arange(pos * block + stride - 1, min((pos + 1) * block, length), stride)
    return rows if len(rows) else torch.tensor([min((pos + 1) * block, length) - 1])


def _per_query_block(q, num_kv: int, block: int, stride: int, pool: int, estimate) -> torch.Tensor:
    """(nb, Hkv, nb): ``estimate(rows, n)``, the (Hkv, n) shares of the sampled rows of a query block
    (R, Hkv, G, D) over the first n pooled key groups of ``pool`` keys, summed into key blocks."""
    length, heads, dim = q.shape
    nb, per_block, n_pooled = -(-length // block), block // pool, -(-length // pool)
    est = torch.zeros(nb, num_kv, nb)
    for pos in range(nb):
        rows = sampled_rows(block, pos, length, stride)
        visible = min((pos + 1) * per_block, n_pooled)
        shares = estimate(q[rows].float().view(len(rows), num_kv, heads // num_kv, dim), visible)
        shares = torch.nn.functional.pad(shares, (0, (pos + 1) * per_block - visible))
        est[pos, :, : pos + 1] = shares.view(num_kv, pos + 1, per_block).sum(-1)
    return est


def pooled_estimate(q, k, block: int, scale: float, stride: int, pool: int | None = None) -> torch.Tensor:
    """(nb, Hkv, nb): the kernels' pooled-key estimate (``search_reference.pooled_estimate``) of every
    ``stride``-th query row. With ``pool`` (a divisor of the block) the means are of ``pool``-key
    sub-blocks and a block's estimate sums its sub-blocks' shares."""
    pool = pool or block
    mean_k, sizes = search_reference.pooled_blocks(k.float(), pool)
    estimate = lambda rows, n: search_reference.pooled_estimate(rows, mean_k[:n], sizes[:n], scale)  # noqa: E731
    return _per_query_block(q, k.shape[1], block, stride, pool, estimate)


def bound_estimate(q, k, block: int, scale: float, stride: int) -> torch.Tensor:
    """(nb, Hkv, nb): the kernels' key-bound estimate (``search_reference.bound_estimate``), q+ . max key +
    q- . min key in place of q . mean key."""
    max_k, min_k, sizes = search_reference.bounding_blocks(k.float(), block)
    estimate = lambda rows, n: search_reference.bound_estimate(rows, max_k[:n], min_k[:n], sizes[:n], scale)  # noqa: E731
    return _per_query_block(q, k.shape[1], block, stride, block, estimate)


def gaussian_estimate(q, k, block: int, scale: float, stride: int) -> torch.Tensor:
    """(nb, Hkv, nb): the pooled estimate with each block's keys taken as independent Gaussians per dimension
    (its mean key, its elementwise variance): a row's logit for a block is the log of the expected sum of
    exp over the block's keys, scale q . mean_key + scale^2 / 2 sum_d q_d^2 var_d + ln n."""
    mean_k, sizes = search_reference.pooled_blocks(k.float(), block)
    mean_sq, _ = search_reference.pooled_blocks(k.float() ** 2, block)
    var_k = (mean_sq - mean_k**2).clamp(min=0)

    def estimate(rows, n):
        logits = torch.einsum("rhgd,jhd->hrgj", rows, mean_k[:n]) * scale
        logits = logits + torch.einsum("rhgd,jhd->hrgj", rows * rows, var_k[:n]) * (scale * scale / 2)
        return torch.softmax(logits + torch.log(sizes[:n]), dim=-1).mean(dim=(1, 2))

    return _per_query_block(q, k.shape[1], block, stride, block, estimate)


def exact_estimate(q, k, block: int, scale: float, rows_per_block: int) -> torch.Tensor:
    """(nb, Hkv, nb): exact causal attention mass per key block of a few rows of each query block."""
    length, heads, dim = q.shape
    num_kv = k.shape[1]
    nb = -(-length // block)
    est = torch.zeros(nb, num_kv, nb)
    keys = torch.arange(length)
    for pos in range(nb):
        rows = sampled_rows(block, pos, length, max(block // rows_per_block, 1))
        qs = q[rows].float().view(len(rows), num_kv, heads // num_kv, dim)
        logits = torch.einsum("rhgd,khd->hgrk", qs, k.float()) * scale
        logits = logits.masked_fill(keys[None, None, None, :] > rows[None, None, :, None], float("-inf"))
        probs = torch.softmax(logits, -1).mean((1, 2))
        est[pos] = torch.nn.functional.pad(probs, (0, nb * block - length)).view(num_kv, nb, block).sum(-1)
    return est


def kept_blocks(est: torch.Tensor, threshold: float, sink: int, local: int) -> torch.Tensor:
    """The kernels' cut: est >= threshold x the row's largest, plus sink, local and diagonal blocks."""
    nb = est.shape[0]
    j, i = torch.arange(nb)[None, None, :], torch.arange(nb)[:, None, None]
    causal = j <= i
    est = est.masked_fill(~causal, 0.0)
    return causal & ((est >= threshold * est.amax(-1, keepdim=True)) | (j < sink) | (j >= i - local))


def at_recall(mass, est, recall: float, sink: int, local: int) -> dict:
    """Bisect the largest threshold whose kept blocks hold at least ``recall`` of the mass on average."""
    low, high, best = 0.0, 1.0, None
    for _ in range(40):
        mid = (low + high) / 2
        quality = selection_quality(mass, kept_blocks(est, mid, sink, local), recall_target=recall)
        if quality["recall"] >= recall:
            best, low = dict(quality, threshold=mid), mid
        else:
            high = mid
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("captures", nargs="+", type=Path, help=".pt files holding q (L, Hq, D) and k (L, Hkv, D)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--recall", type=float, default=0.95)
    parser.add_argument("--query-stride", type=int, default=4, help="of the pooled-key estimate")
    parser.add_argument("--exact-rows", default="1,2,8", help="rows per block of the exact estimates")
    parser.add_argument("--pooled", default="", help="more pooled estimates, as stride:pool pairs (e.g. 16:32,8:64)")
    parser.add_argument("--sink-blocks", type=int, default=1)
    parser.add_argument("--local-blocks", type=int, default=2)
    args = parser.parse_args()
    print("| layer | estimator | threshold | recall | density | / oracle at the achieved recall | / oracle at "
          f"{args.recall:g} in every row |\n|---|---|---|---|---|---|---|")
    for path in args.captures:
        data = torch.load(path)
        q, k = data["q"], data["k"]
        scale = data.get("scale") or q.shape[-1] ** -0.5
        mass = block_attention_mass(q, k, args.block_size, scale)
        estimates = {
            f"pooled keys, stride {args.query_stride}": pooled_estimate(q, k, args.block_size, scale, args.query_stride),
            f"key bounds, stride {args.query_stride}": bound_estimate(q, k, args.block_size, scale, args.query_stride),
            f"Gaussian keys, stride {args.query_stride}": gaussian_estimate(q, k, args.block_size, scale,
                                                                          args.query_stride),
        }
        for pair in filter(None, args.pooled.split(",")):
            stride, pool = (int(x) for x in pair.split(":"))
            estimates[f"pooled {pool}-key means, stride {stride}"] = pooled_estimate(q, k, args.block_size, scale, stride, pool)
        for n in (int(x) for x in filter(None, args.exact_rows.split(","))):
            estimates[f"exact, {n} row{'s' if n > 1 else ''} per block"] = exact_estimate(q, k, args.block_size, scale, n)
        for name, est in estimates.items():
            r = at_recall(mass, est, args.recall, args.sink_blocks, args.local_blocks)
            print(f"| {path.stem} | {name} | {r['threshold']:.2g} | {r['recall']:.3f} | {r['density']:.3f} "
                  f"| {r['density'] / r['oracle_density']:.2f}x | {r['density'] / r['oracle_density_95']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
