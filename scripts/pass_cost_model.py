"""How well the load-aware policy's pass-cost model predicts measured batched passes.

    PYTHONPATH=src .venv/bin/python scripts/pass_cost_model.py --batch 2 4 8 16 --rounds 3

The policy (``engine/gamma.py``, :class:`LoadAwareGamma`) prices a pass of r rows and n
tokens as T(r, n) = K(n) + R(r) − K(r), from two measured curves: K on one row of n tokens
and R on r rows of one token (``engine/costs.py``, :func:`pass_cost_curves`). This script
measures both, then passes of n tokens spread over B rows (a batched round's shape,
:func:`rows_verify_cost`), and prints measured T_B(n)/T(1) against the model's prediction
and against K(n) alone (one curve in total tokens, what the engine and server priced every
pass with before). Each round measures all three afresh; the table gives means over
rounds, so the machine's drift hits every column alike.
"""

from __future__ import annotations

import argparse
import json
import statistics

from speculative.engine.costs import pass_cost_curves, probe_context, rows_verify_cost
from speculative.engine.gamma import LoadAwareGamma
from speculative.hardware import cpu_info
from speculative.targets import load_target

POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3, help="fresh measurements averaged")
    parser.add_argument("--repeats", type=int, default=3, help="medians within a round")
    parser.add_argument("--json", action="store_true", help="one JSON object instead")
    args = parser.parse_args()
    lm = load_target(args.target, "native", args.precision).lm
    context = probe_context(lm.vocab_size)
    rows = max(args.batch)
    samples: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        curves = pass_cost_curves(lm, context, rows, max(POINTS), args.repeats)
        policy = LoadAwareGamma(curves.tokens, rows_cost=curves.rows)
        for batch in args.batch:
            measured = rows_verify_cost(lm, context, POINTS, args.repeats, batch)
            for n, value in measured.items():
                predicted = policy.pass_cost(min(n, batch), n)
                samples.setdefault((batch, n), []).append((value, predicted, policy.cost(n)))
    table = [
        {
            "rows": b,
            "tokens": n,
            **dict(zip(("measured", "model", "tokens_only"), means, strict=True)),
        }
        for (b, n), values in sorted(samples.items())
        for means in [[statistics.mean(v[i] for v in values) for i in range(3)]]
    ]
    if args.json:
        print(json.dumps({"cpu": cpu_info().as_dict(), "passes": table}))
        return
    print(f"cpu: {cpu_info().summary()}")
    print("B   n | measured T_B(n)/T(1) | K(n) + R(r) - K(r) (÷ measured) | K(n) (÷ measured)")
    for row in table:
        m, p, k = row["measured"], row["model"], row["tokens_only"]
        print(
            f"{row['rows']:2d} {row['tokens']:3d} | {m:6.2f} | {p:6.2f} ({p / m:.2f}) | "
            f"{k:6.2f} ({k / m:.2f})"
        )


if __name__ == "__main__":
    main()
