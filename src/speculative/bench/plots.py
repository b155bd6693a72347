"""PNG plots of a benchmark run (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from speculative.bench.methods import OURS
from speculative.bench.report import ALL, ResultRow


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def speedup_by_category(rows: Sequence[ResultRow], path: Path) -> None:
    """Grouped bars: speedup vs plain decoding for every configuration in every category."""
    plt = _pyplot()
    cats = list(dict.fromkeys(r.category for r in rows))
    configs = [c for c in dict.fromkeys(r.config for r in rows) if not c.endswith("/plain")]
    lookup = {(r.config, r.category): r.speedup_vs_plain or 0.0 for r in rows}
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(cats)), 5))
    for i, config in enumerate(configs):
        xs = [j + (i - len(configs) / 2 + 0.5) * width for j in range(len(cats))]
        ax.bar(xs, [lookup[config, c] for c in cats], width, label=config)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel("speedup vs plain decoding")
    ax.set_title("Speedup by category and method")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance_by_position(rows: Sequence[ResultRow], path: Path) -> None:
    """Conditional acceptance of drafted position i given positions before it accepted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        if row.category != ALL or row.engine != OURS or not row.per_position_acceptance:
            continue
        rates = row.per_position_acceptance
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=row.config)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position (all prompts)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def predicted_vs_realized(rows: Sequence[ResultRow], path: Path) -> None:
    """Realized speedup against the seed formula's and the generalized prediction."""
    plt = _pyplot()
    points = [r for r in rows if r.predicted_speedup is not None and r.speedup_vs_plain]
    fig, ax = plt.subplots(figsize=(6, 6))
    seed = [(r.predicted_speedup, r.speedup_vs_plain) for r in points]
    general = [(r.predicted_speedup_generalized, r.speedup_vs_plain) for r in points]
    if seed:
        ax.scatter(*zip(*seed, strict=True), label="seed formula (T(k)=T(1))", alpha=0.7)
        ax.scatter(*zip(*general, strict=True), label="generalized (measured T(k))", alpha=0.7)
    values = [v for pair in seed + general for v in pair if v is not None] or [1.0]
    top = max(values) * 1.1
    ax.plot([0, top], [0, top], color="gray", linewidth=0.8, label="realized = predicted")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("predicted speedup")
    ax.set_ylabel("realized speedup")
    ax.set_title("Predicted vs realized (each config × category)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTS = {
    "speedup_by_category.png": speedup_by_category,
    "acceptance_by_position.png": acceptance_by_position,
    "predicted_vs_realized.png": predicted_vs_realized,
}


def write_plots(rows: Sequence[ResultRow], folder: Path) -> list[str]:
    """Write every plot into ``folder``; returns their file names."""
    for name, draw in PLOTS.items():
        draw(rows, folder / name)
    return list(PLOTS)
