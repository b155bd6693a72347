"""`speculative simulate`: the specification's experiments, vectorized."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

import numpy as np
from tqdm import tqdm

from speculative.cli.common import CliError, Formatter, add_json_flag, emit_json, positive_int
from speculative.simulation import (
    markov_experiment,
    round_length_experiment,
    single_step_experiment,
)

DESCRIPTION = """\
Reproduce the specification's experiments.

  markov  (default) two toy models as last-token stochastic matrices: target P and a
          blurred draft Q. Generates --sequences sequences of --length tokens target-only
          and speculatively (γ = --gamma drafted tokens per round, one target call per
          round), then compares token frequencies and counts target calls.
  step    the single-position primitive: accept a drafted x ~ q with probability
          min(1, p(x)/q(x)), else resample from normalize(max(0, p − q)); compares the
          empirical distribution with p and the accept rate with Σ min(p, q) = 1 − TV.
  rounds  tokens emitted per round under i.i.d. acceptance α versus the formula
          (1 − α^(γ+1)) / (1 − α) (accepted tokens plus the recovered-or-bonus token).
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="reproduce the specification's Monte Carlo experiments",
        description=DESCRIPTION,
        formatter_class=Formatter,
    )
    parser.add_argument(
        "--experiment",
        choices=["markov", "step", "rounds"],
        default="markov",
        help="which experiment to run",
    )
    parser.add_argument("--vocab", type=positive_int, default=5, help="Markov vocabulary size")
    parser.add_argument("--length", type=positive_int, default=64, help="tokens per sequence")
    parser.add_argument("--gamma", type=positive_int, default=4, help="drafted tokens per round")
    parser.add_argument(
        "--sequences", type=positive_int, default=60_000, help="number of sequences (markov)"
    )
    parser.add_argument(
        "--draws", type=positive_int, default=2_000_000, help="number of draws (step)"
    )
    parser.add_argument(
        "--trials", type=positive_int, default=300_000, help="rounds per cell (rounds)"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="random seed (default: as in the specification)"
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)


def fmt(values: list[float]) -> str:
    return np.array2string(np.asarray(values), precision=4, floatmode="fixed")


def run(args: argparse.Namespace) -> int:
    experiments = {"markov": run_markov, "step": run_step, "rounds": run_rounds}
    return experiments[args.experiment](args)


def run_markov(args: argparse.Namespace) -> int:
    if args.vocab < 2:
        raise CliError(f"--vocab must be >= 2, got {args.vocab}")
    if args.sequences < 2:
        raise CliError(f"--sequences must be >= 2, got {args.sequences}")
    seed = 2 if args.seed is None else args.seed
    total = args.sequences * args.length
    started = time.perf_counter()
    with tqdm(total=total, unit="tok", desc="speculative", leave=False, disable=None) as bar:

        def progress(done: int) -> None:
            bar.update(done - bar.n)

        report = markov_experiment(
            args.vocab, args.length, args.gamma, args.sequences, seed, progress=progress
        )
    seconds = time.perf_counter() - started
    print(f"token freq, target-only : {fmt(report.target_freq)}")
    print(f"token freq, speculative : {fmt(report.speculative_freq)}")
    print(
        f"max abs diff            : {report.max_abs_diff:.5f}  (SE ~ {report.standard_error:.5f})"
    )
    print(f"tokens per target call  : {report.tokens_per_target_call:.2f}")
    print(f"target calls saved      : {report.target_calls_saved * 100:.0f}%")
    print(f"({args.sequences} sequences × {args.length} tokens, γ = {args.gamma}, {seconds:.1f} s)")
    if args.json:
        emit_json({"experiment": "markov", "seed": seed, "seconds": seconds, **asdict(report)})
    return 0


def run_step(args: argparse.Namespace) -> int:
    seed = 0 if args.seed is None else args.seed
    report = single_step_experiment(draws=args.draws, seed=seed)
    print(f"target p  : {fmt(report.target)}")
    print(f"empirical : {fmt(report.empirical)}")
    print(f"max error : {report.max_error:.5f}  (sampling SE ~ {report.standard_error:.5f})")
    print(f"accept rate: {report.accept_rate:.4f}")
    print(f"sum min(p,q): {report.overlap:.4f}")
    print(f"1 - TV(p,q): {report.one_minus_tv:.4f}")
    if args.json:
        emit_json({"experiment": "step", "seed": seed, **asdict(report)})
    return 0


def run_rounds(args: argparse.Namespace) -> int:
    seed = 1 if args.seed is None else args.seed
    rows = round_length_experiment(trials=args.trials, seed=seed)
    print("alpha  gamma   formula   simulated")
    for row in rows:
        print(f" {row.alpha:.1f}     {row.gamma:2d}     {row.formula:.4f}    {row.simulated:.4f}")
    if args.json:
        emit_json({"experiment": "rounds", "seed": seed, "rows": [asdict(r) for r in rows]})
    return 0
