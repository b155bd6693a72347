"""`speculative theory`: the optimal-γ table and the speedup chart."""

from __future__ import annotations

import argparse
from pathlib import Path

from speculative.cli.common import (
    Formatter,
    add_json_flag,
    emit_json,
    non_negative_float,
    positive_int,
    probability,
)
from speculative.theory import ceiling, optimal_gamma, speedup

DESCRIPTION = """\
Print the optimal draft length for each acceptance rate.

  α (alpha)  probability a drafted token is accepted, Σ min(p, q) = 1 − TV(p, q)
  γ (gamma)  number of tokens drafted per round
  c          cost of one draft step as a fraction of one target pass
  speedup    (1 − α^(γ+1)) / ((1 − α)(γc + 1)): expected tokens per round ÷ round cost
  ceiling    1 / (1 − α): the most tokens per round any γ can reach

Example (the specification's table):
  speculative theory --alpha 0.5 0.6 0.7 0.8 0.9 --c 0.1 --plot speedup.png
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "theory",
        help="optimal-γ table and speedup chart from the closed-form theory",
        description=DESCRIPTION,
        formatter_class=Formatter,
    )
    parser.add_argument(
        "--alpha", type=probability, nargs="+", required=True, help="acceptance rate(s) α"
    )
    parser.add_argument(
        "--c", type=non_negative_float, required=True, help="draft cost per step ÷ target pass"
    )
    parser.add_argument("--max-gamma", type=positive_int, default=20, help="largest γ searched")
    parser.add_argument("--plot", type=Path, help="write the speedup-vs-γ chart to this PNG")
    add_json_flag(parser)
    parser.set_defaults(run=run)


def theory_rows(alphas: list[float], c: float, max_gamma: int) -> list[dict[str, float]]:
    rows = []
    for alpha in alphas:
        best_gamma, best = optimal_gamma(alpha, c, max_gamma)
        rows.append(
            {
                "alpha": alpha,
                "best_gamma": best_gamma,
                "speedup": best,
                "ceiling": None if alpha == 1 else ceiling(alpha),  # infinite at α = 1
            }
        )
    return rows


def plot_speedup(alphas: list[float], c: float, max_gamma: int, path: Path) -> None:
    """Speedup against γ for each α, optimum dotted, parity line at 1×."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gammas = list(range(1, max_gamma + 1))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for alpha in alphas:
        values = [speedup(alpha, g, c) for g in gammas]
        (line,) = ax.plot(gammas, values, label=f"α = {alpha:g}")
        best_gamma, best = optimal_gamma(alpha, c, max_gamma)
        ax.plot([best_gamma], [best], "o", color=line.get_color())
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="parity (1×)")
    ax.set_xlabel("draft length γ")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"Speedup vs draft length (c = {c:g})")
    ax.set_xticks(gammas)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    rows = theory_rows(args.alpha, args.c, args.max_gamma)
    print(f"draft cost c = {args.c:g}\n")
    print("alpha  best gamma   speedup   ceiling 1/(1-alpha)")
    for row in rows:
        print(
            f" {row['alpha']:.1f}      {row['best_gamma']:2d}         "
            f"{row['speedup']:.2f}x        {ceiling(row['alpha']):.1f}x"
        )
    if args.plot:
        plot_speedup(args.alpha, args.c, args.max_gamma, args.plot)
        print(f"\nchart written to {args.plot}")
    if args.json:
        emit_json({"c": args.c, "max_gamma": args.max_gamma, "rows": rows})
    return 0
