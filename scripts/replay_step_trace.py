#!/usr/bin/env python3
"""Replay a step trace (PREFILL_ACCEL_STEP_TRACE) through the step-time model and report its errors.

Each traced step is predicted by a fresh `prefill_accel.scheduling.step_time.StepTimeModel` fed every step before it,
as the engine's model was, then fed to it. The table groups the steps by kind (decodes only, decodes with a
prefill chunk, prefill chunks only) and chunk size, with the measured and predicted step time (medians) and
the median relative error. With --capture-size N the chunk sizes are split at N tokens, where vLLM stops
replaying CUDA graphs (its largest capture size).

  python scripts/replay_step_trace.py docs/results/e2e/vllm-0.26.0-h200-2026-12-01-run10-steps.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

def read_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def replay(steps: list[dict], token_scale: int, max_model_len: int) -> list[tuple[dict, float]]:
    """(step, prediction before it) for every step of each engine process in the trace, in order."""
    from prefill_accel.scheduling.step_time import STEP_FEATURES, StepTimeModel

    models: dict[int, StepTimeModel] = {}
    predicted = []
    for step in steps:
        model = models.setdefault(step.get("pid", 0), StepTimeModel(token_scale, float(token_scale) * max_model_len))
        features = {name: step[name] for name in STEP_FEATURES}
        predicted.append((step, model.step_seconds(**features)))
        model.observe(step["seconds"], **features)
    return predicted


def kind(step: dict, capture_size: int) -> str:
    if not step["prefill_tokens"]:
        return "decodes only"
    size = "<= %d" % capture_size if step["decode_tokens"] + step["prefill_tokens"] <= capture_size else "> %d" % capture_size
    return ("decodes + prefill, " if step["decode_tokens"] else "prefill only, ") + f"{size} tokens"


def report(predicted: list[tuple[dict, float]], capture_size: int) -> list[dict]:
    groups: dict[str, list[tuple[dict, float]]] = {}
    for step, guess in predicted:
        groups.setdefault(kind(step, capture_size), []).append((step, guess))
    rows = []
    for name, members in sorted(groups.items()):
        measured = [s["seconds"] for s, _ in members]
        rows.append({
            "kind": name, "steps": len(members),
            "measured_ms": 1e3 * statistics.median(measured),
            "predicted_ms": 1e3 * statistics.median(g for _, g in members),
            "median_rel_error": statistics.median(abs(g - s["seconds"]) / s["seconds"] for s, g in members if s["seconds"] > 0),
        })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a PREFILL_ACCEL_STEP_TRACE file (.jsonl or .jsonl.gz)")
    parser.add_argument("--token-scale", type=int, default=8192, help="the engine's max_num_batched_tokens")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--capture-size", type=int, default=512, help="vLLM's largest CUDA graph capture size")
    args = parser.parse_args()
    rows = report(replay(read_trace(args.trace), args.token_scale, args.max_model_len), args.capture_size)
    print("| steps | count | measured ms (median) | predicted ms (median) | median relative error |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['steps']} | {r['measured_ms']:.2f} | {r['predicted_ms']:.2f} | {r['median_rel_error']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
