"""Aggregate tokens/s of batched decoding: plain vs speculative (fixed γ, load-aware γ).

    PYTHONPATH=src python scripts/batch_bench.py [--precision fp32] [--tokens 64]
        [--batch 1 2 4 8] [--drafter ngram] [--gamma 4] [--repeats 2]
        [--threads 1 --clock cpu]   # CPU time: robust when other jobs share the cores

One process, default model on the native runtime, greedy. First measures the verify-cost
curve T(n)/T(1) of one ragged pass of n tokens (the load-aware policy's input), then for
each batch size B runs B prompts (64 new tokens each) through BatchEngine with every
configuration in turn, and reports aggregate decode tokens/s (the first round, which holds
every row's prefill, is excluded from tokens and time; median over repeats), the mean γ
per round, and whether every configuration's outputs equal plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from speculative.bench.prompts import load_prompts
from speculative.engine import StopCriteria
from speculative.engine.batch import BatchEngine, BatchRequest
from speculative.engine.gamma import LoadAwareGamma
from speculative.models.base import RowInput
from speculative.pipeline import build_drafter, encode_prompt, load_target
from speculative.sampling import SamplingParams

POINTS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def verify_cost_curve(
    model: Any, context: list[int], clock: Callable[[], float], repeats: int = 5
) -> dict[int, float]:
    """T(n)/T(1): median time of a forward_rows pass of n tokens, spread over rows of 1..8
    tokens each as in a batched round, after each row's context; caches rolled back."""
    slots = [model.acquire_slot() for _ in range(8)]
    model.forward_rows([RowInput(s, torch.tensor(context)) for s in slots])
    times: dict[int, list[float]] = {n: [] for n in POINTS}
    for _ in range(repeats):
        for n in POINTS:
            sizes = [n // 8 + (i < n % 8) for i in range(8)]
            rows = [
                RowInput(s, torch.tensor(context[:k]))
                for s, k in zip(slots, sizes, strict=True)
                if k
            ]
            started = clock()
            model.forward_rows(rows)
            times[n].append(clock() - started)
            for row in rows:
                model.rollback_slot(row.slot, row.input_ids.numel())
    for s in slots:
        model.release_slot(s)
    base = statistics.median(times[1])
    return {n: statistics.median(t) / base for n, t in times.items()}


def run_batch(
    target: Any,
    prompts: list[list[int]],
    label: str,
    load: LoadAwareGamma | None,
    gamma: int,
    args: argparse.Namespace,
    params: SamplingParams,
    stop: StopCriteria,
    clock: Callable[[], float],
) -> tuple[list[Any], int, float, int]:
    """One batch to completion: (results, decode tokens, decode seconds, decode passes)."""
    engine = BatchEngine(target.lm, max_batch=len(prompts), load=load)
    for prompt in prompts:
        drafter = build_drafter(args.drafter, target) if gamma else None
        engine.add(BatchRequest(prompt, params, stop, torch.Generator(), drafter, gamma))
    engine.step()  # the prefill round
    first_tokens = sum(len(r.state.generated) for r in engine.rows.values())
    started, passes = clock(), 0
    while engine.rows:
        engine.step()
        passes += 1
    spent = clock() - started
    results = [engine.finished[i] for i in sorted(engine.finished)]
    return results, sum(len(r.token_ids) for r in results) - first_tokens, spent, passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-gamma", type=int, default=8, help="load-aware: a row's cap")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="threads (0: leave as is)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    target = load_target("default", "native", args.precision)
    prompts = load_prompts()
    by_category: dict[str, list] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    mixed = [p for group in zip(*by_category.values(), strict=False) for p in group]
    ids = [
        encode_prompt(target.tokenizer, p.prompt, p.messages and list(p.messages)) for p in mixed
    ]
    verify_cost_curve(target.lm, ids[0][:64], clock, repeats=1)  # warm-up
    curve = verify_cost_curve(target.lm, ids[0][:64], clock)
    print("T(n)/T(1):", {n: round(v, 2) for n, v in curve.items()})
    params = SamplingParams(temperature=0)
    stop = StopCriteria(max_new_tokens=args.tokens)  # no EOS: every row emits all tokens
    configs = {
        "plain": (None, 0),
        f"{args.drafter} γ={args.gamma}": (None, args.gamma),
        f"{args.drafter} load-aware": (LoadAwareGamma(curve), args.max_gamma),
    }
    table = []
    for batch in args.batch:
        outputs = {}
        seconds: dict[str, list[float]] = {label: [] for label in configs}
        runs: dict[str, tuple[list[Any], int, int]] = {}
        for _ in range(args.repeats):  # configurations interleaved: drift hits all alike
            for label, (load, gamma) in configs.items():
                results, new, spent, passes = run_batch(
                    target, ids[:batch], label, load, gamma, args, params, stop, clock
                )
                seconds[label].append(spent)
                outputs[label] = [r.token_ids for r in results]
                runs[label] = (results, new, passes)
        for label in configs:
            results, new, passes = runs[label]
            spent = statistics.median(seconds[label])
            mean_gamma = statistics.mean(g for r in results for g in r.stats.gammas[1:] or [0])
            row = {
                "batch": batch,
                "config": label,
                "tok_s": round(new / spent, 1),
                "passes": passes,
                "mean_gamma": round(mean_gamma, 2),
                "identical": outputs[label] == outputs["plain"],
            }
            table.append(row)
            print(
                f"B={batch:2d} {label:20s} {row['tok_s']:7.1f} tok/s  passes {passes:3d}  "
                f"mean γ {row['mean_gamma']:4.2f}  identical {row['identical']}",
                flush=True,
            )
    plain = {r["batch"]: r["tok_s"] for r in table if r["config"] == "plain"}
    for row in table:
        row["vs_plain"] = round(row["tok_s"] / plain[row["batch"]], 2)
        row["vs_plain_b1"] = round(row["tok_s"] / plain[args.batch[0]], 2)
    meta = {"precision": args.precision, "tokens": args.tokens, "threads": torch.get_num_threads()}
    print(json.dumps({**meta, "verify_cost": curve, "rows": table}))


if __name__ == "__main__":
    main()
