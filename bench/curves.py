"""One PNG of several per-step curves (the peer benchmarks' reward curves: bench/verl_vs_native.py,
bench/trl_vs_native.py)."""

from __future__ import annotations

from pathlib import Path


def plot_curves(curves: dict[str, list[float]], path: Path, *, xlabel: str, ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
