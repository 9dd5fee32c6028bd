"""PNG plots of a bench run (matplotlib, headless): TTFT against context length, and the speed-up."""

from __future__ import annotations

from pathlib import Path

from .errors import require


def _pyplot():
    matplotlib = require("matplotlib", "the bench plots (or pass --no-plots)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes(plt, title: str, ylabel: str):
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    return figure, axes


def _save(plt, figure, axes, lengths: list[int], path: Path) -> None:
    axes.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)


def plot_ttft(result: dict, path: Path) -> None:
    """TTFT median per length for every server, an error bar up to the p90."""
    plt = _pyplot()
    figure, axes = _axes(plt, f"Time to first token, {result['config']['model']}", "TTFT (s), median and p90")
    lengths = []
    for name, server in result["servers"].items():
        rows = [(int(k), v["ttft_s"]) for k, v in server["lengths"].items() if v["ttft_s"]["median"] is not None]
        if not rows:
            continue
        xs = [n for n, _ in rows]
        medians = [t["median"] for _, t in rows]
        upper = [t["p90"] - t["median"] for _, t in rows]
        axes.errorbar(xs, medians, yerr=[[0] * len(rows), upper], marker="o", capsize=3, label=name)
        lengths = sorted(set(lengths) | set(xs))
    _save(plt, figure, axes, lengths, path)


def plot_speedup(result: dict, path: Path) -> None:
    """Baseline TTFT median over accelerated TTFT median per length; 1 marks no change."""
    plt = _pyplot()
    figure, axes = _axes(plt, f"TTFT speed-up over the baseline, {result['config']['model']}", "speed-up (x)")
    rows = sorted((int(k), v["ttft"]) for k, v in result["speedup"].items() if v["ttft"])
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="no change")
    axes.plot([n for n, _ in rows], [r for _, r in rows], marker="o", label="TTFT speed-up")
    _save(plt, figure, axes, [n for n, _ in rows], path)
