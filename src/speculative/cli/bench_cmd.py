"""`speculative bench`: speed of every method on a prompt suite, against transformers."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from speculative.cli.common import (
    NO_DEFAULT,
    Formatter,
    add_json_flag,
    emit_json,
    every_core,
    non_negative_float,
    positive_int,
    probability,
)
from speculative.cli.generate_cmd import add_kv_cache_argument
from speculative.drafters.tree import TREE_MODES

DESCRIPTION = """\
Benchmark lossless speculative decoding on a prompt suite (greedy decoding).

Compared on the same prompts, model and token budget:
  plain                  our plain autoregressive decoding (the reference)
  DRAFTER × γ            every drafter (--drafters, plus any --draft) with every --gamma:
                         fixed values, 'auto' (adaptive γ from the measured draft cost c and
                         verify-cost curve T(k)) and 'heuristic' (transformers' +2/−1 schedule)
  × runtime              every --runtime given
  transformers peers     model.generate() plain, with assistant_model= (the bf16 copy or the
                         draft model) and with prompt_lookup_num_tokens= (ngram's equivalent)

The built-in suite has 80 prompts written for this project in 8 categories (multi-turn
chat, translation, summarization, question answering, math reasoning, retrieval QA, code
completion, code editing); --prompts FILE takes your own JSONL with one object per line:
{"category": ..., "prompt": ...} or {"category": ..., "messages": [{"role", "content"}...]}.

Configurations are interleaved prompt by prompt (drift on a shared machine hits all of
them alike); after one warm-up run each, a prompt's time is the median of --repeats runs.
Reported per category and overall: tokens/s, speedup vs plain and vs transformers' same
method, acceptance α, mean accepted length τ, acceptance by draft position, the measured
c and T(k)/T(1), the speedups the seed formula and the generalized one predict, and
realized ÷ predicted. Every output is checked token for token against plain decoding.

Defaults are what a user gets: --runtime auto (the native runtime where it supports the
model, at the model's own precision: int4 for the default GGUF), every core, and the
drafters that can pay (ngram, self-int4, eagle, auto; a self-<precision> drafter no cheaper
than the target, e.g. self-int4 on an int4 target, is dropped with a note). Tokens/s is
reported end to end (prompt prefill included) and decode-only (after the prefill), each
with its speedup over plain decoding. --quick: 1 prompt per category, 128 new tokens (so
decoding, not the prefill, dominates), γ 4/auto/heuristic, 1 repeat. The full mode (80
prompts, 128 new tokens, γ 2/4/auto/heuristic, 3 repeats) takes hours on 2 cores; trim it
with --per-category, --repeats, --max-new-tokens and --gamma.

--concurrency B [B ...] switches to batched decoding: for each batch size B, the same
prompts (as many as the largest B, categories interleaved) are decoded B at a time by the
batched engine (closed batches, one after another) with plain batched decoding, the
first drafter at a fixed γ (the first integer --gamma, default 4) and load-aware γ
(--max-gamma caps it), side by side, plus transformers' padded batched
generate() where it can load the target. Each closed batch runs under every setup before
the next batch starts, so a setup and plain decoding run seconds apart; ×plain is the
median over the repeats of the ratio within a repeat. Reported: aggregate and per-request
tokens/s, ratios to plain, the mean γ chosen, target passes, the share of time in the target pass,
what bounds the passes on the C kernels (binds: memory or compute, from the machine's peaks
measured at start; floors: the passes' floors ÷ the decode time, so 100% would be every pass
at its roofline and no time outside them), and identity with plain decoding; --out writes
concurrency.json and concurrency.md.
e.g. speculative bench --concurrency 1 2 4 8 16 --runtime native --max-new-tokens 32
"""


@dataclass(frozen=True)
class ModeDefaults:
    """Defaults of options left unset, for the full and the --quick mode."""

    per_category: int | None
    max_new_tokens: int
    gammas: tuple[str, ...]
    repeats: int
    cost_repeats: int
    warmup_tokens: int


FULL = ModeDefaults(None, 128, ("2", "4", "auto", "heuristic"), 3, 7, 16)
QUICK = ModeDefaults(1, 128, ("4", "auto", "heuristic"), 1, 3, 8)
DEFAULT_DRAFTERS = ["ngram", "self-int4", "eagle", "auto"]  # those that can pay


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark methods, γ schedules and transformers' generate() on a prompt suite",
        description=DESCRIPTION,
        formatter_class=Formatter,
    )
    parser.add_argument(
        "--target",
        default="default",
        help="target model: 'default' (SmolLM2-135M-Instruct), a folder, a .gguf or a hub id",
    )
    parser.add_argument(
        "--runtime",
        nargs="+",
        default=["auto"],
        help="runtimes to compare (each one a config): auto (native where supported), "
        "native, hf (transformers; also enables its generate() peers)",
    )
    parser.add_argument(
        "--precision",
        default="auto",
        help="target weight precision (auto: the model's own, e.g. int4 for a Q4 GGUF)",
    )
    add_kv_cache_argument(parser)
    parser.add_argument(
        "--drafters",
        nargs="*",
        default=DEFAULT_DRAFTERS,
        help="built-in drafters to compare (none: only --draft ones); those a target cannot "
        "use or that cannot be cheaper than it are skipped with a note",
    )
    parser.add_argument(
        "--draft",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="extra drafters: self-exit:N, or a draft model's folder / hub id" + NO_DEFAULT,
    )
    parser.add_argument(
        "--gamma",
        nargs="+",
        default=None,
        metavar="G",
        help="γ settings: integers, 'auto', 'heuristic' (default: 2 4 auto heuristic; "
        "quick: 4 auto heuristic)" + NO_DEFAULT,
    )
    parser.add_argument(
        "--tree",
        nargs="+",
        default=["off"],
        choices=TREE_MODES,
        help="token-tree rows besides the chains: each drafter that drafts trees also runs "
        "with these shapes (budget sized from the measured verify-cost curve)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="token budget per prompt (default 128; quick: 128)" + NO_DEFAULT,
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="runs per prompt (default 3; quick: 1)" + NO_DEFAULT,
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="JSONL prompt file (default: the built-in suite)" + NO_DEFAULT,
    )
    parser.add_argument(
        "--structured",
        action="store_true",
        help="the built-in JSON-output suite instead of the eight categories: each prompt's "
        "output constrained by its JSON schema (structured outputs; no peers: they take no "
        "grammar). A --prompts file's records may carry a json_schema too",
    )
    parser.add_argument(
        "--per-category",
        type=positive_int,
        default=None,
        help="use only the first N prompts of each category (default all; quick: 1)" + NO_DEFAULT,
    )
    parser.add_argument(
        "--no-peers", action="store_true", help="skip transformers' generate() configurations"
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0: greedy (outputs must equal plain decoding); > 0: sampling, rows report "
        "speedup and τ (outputs differ by chance, not compared), e.g. 0.8 with --top-p 0.95",
    )
    parser.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass when sampling")
    chat = parser.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat", dest="chat", action="store_true", default=None,
        help="wrap prompts in the chat template (default if the model has one)" + NO_DEFAULT,
    )  # fmt: skip
    chat.add_argument(
        "--no-chat", dest="chat", action="store_false", help="raw prompts" + NO_DEFAULT
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help=f"torch intra-op threads (default: every core, {every_core()} here; 1 is "
        "steadiest on a shared CPU)",
    )
    parser.add_argument("--quick", action="store_true", help="a few-minute smoke run (see above)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write bench.json, report.md and PNG plots here" + NO_DEFAULT,
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="B",
        help="batched mode: batch sizes to compare (see above)" + NO_DEFAULT,
    )
    parser.add_argument(
        "--max-gamma",
        type=positive_int,
        default=8,
        help="batched mode: a row's γ cap under the load-aware policy",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="batched mode: wall time, or process CPU time (steadier when other jobs share "
        "the cores; use with --threads 1)",
    )
    parser.add_argument(
        "--no-roofline",
        dest="roofline",
        action="store_false",
        help="batched mode: skip measuring the machine's peaks (under a second) and the "
        "'binds' and 'floors' columns",
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace):
    from speculative.bench import BenchSettings, parse_gamma_choices

    mode = QUICK if args.quick else FULL
    drafters = tuple(dict.fromkeys([d for d in args.drafters if d != "none"] + args.draft))
    return BenchSettings(
        target=args.target,
        runtimes=tuple(dict.fromkeys(args.runtime)),
        precision=args.precision,
        kv_cache=args.kv_cache,
        drafters=drafters,
        gammas=tuple(parse_gamma_choices(args.gamma or mode.gammas)),
        trees=tuple(t for t in dict.fromkeys(args.tree) if t != "off"),
        peers=not args.no_peers,
        max_new_tokens=args.max_new_tokens or mode.max_new_tokens,
        repeats=args.repeats or mode.repeats,
        warmup_tokens=mode.warmup_tokens,
        cost_repeats=mode.cost_repeats,
        chat=args.chat,
        progress=not args.no_progress,
        temperature=args.temperature,
        top_p=args.top_p,
    )


def run(args: argparse.Namespace) -> int:
    if args.concurrency:
        return run_concurrency_mode(args)
    return run_suite_mode(args)


def concurrency_settings(args: argparse.Namespace):
    from speculative.bench.concurrency import ConcurrencySettings
    from speculative.cli.common import CliError

    mode = QUICK if args.quick else FULL
    drafters = [d for d in [*args.draft, *args.drafters] if d != "none"]
    fixed = [int(g) for g in (args.gamma or ["4"]) if g.isdigit() and int(g) > 0]
    if args.temperature != 0:
        raise CliError("--concurrency runs greedy decoding only (drop --temperature)")
    if args.structured:
        raise CliError("--concurrency runs free text only (drop --structured)")
    return ConcurrencySettings(
        target=args.target,
        runtimes=tuple(dict.fromkeys(args.runtime)),
        precision=args.precision,
        kv_cache=args.kv_cache,
        drafter=drafters[0] if drafters else "ngram",
        gamma=fixed[0] if fixed else 4,
        max_gamma=args.max_gamma,
        concurrency=tuple(dict.fromkeys(args.concurrency)),
        max_new_tokens=args.max_new_tokens or mode.max_new_tokens,
        repeats=args.repeats or mode.repeats,
        peers=not args.no_peers,
        chat=args.chat,
        progress=not args.no_progress,
        clock=args.clock,
        roofline=args.roofline,
    )


def run_concurrency_mode(args: argparse.Namespace) -> int:
    import torch

    from speculative.bench import load_prompts
    from speculative.bench.concurrency import (
        concurrency_payload,
        concurrency_terminal,
        run_concurrency,
        write_concurrency,
    )
    from speculative.cli.common import CliError

    settings = concurrency_settings(args)
    prompts = load_prompts(args.prompts)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or every_core())
    try:
        bench = run_concurrency(settings, prompts)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    finally:
        torch.set_num_threads(threads)
    print(concurrency_terminal(bench))
    if args.out is not None:
        written = write_concurrency(bench, args.out)
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if args.json:
        emit_json(concurrency_payload(bench))
    return 0


def run_suite_mode(args: argparse.Namespace) -> int:
    import torch

    from speculative.bench import (
        load_prompts,
        payload,
        run_bench,
        summarize,
        terminal_report,
        write_outputs,
    )
    from speculative.bench.prompts import take_per_category
    from speculative.cli.common import CliError

    if args.structured and args.prompts is not None:
        raise CliError("--structured is a built-in suite: give it or --prompts, not both")
    settings = settings_from_args(args)  # validates --gamma before loading anything
    mode = QUICK if args.quick else FULL
    try:
        suite = load_prompts(args.prompts, structured=args.structured)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    prompts = take_per_category(suite, args.per_category or mode.per_category)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or every_core())
    try:
        bench = run_bench(settings, prompts)
    except ValueError as exc:  # a schema that cannot be compiled, say
        raise CliError(str(exc)) from None
    finally:
        torch.set_num_threads(threads)
    rows = summarize(bench)
    for mismatch in bench.mismatches:
        print(f"speculative: warning: {mismatch.describe()}", file=sys.stderr)
    print(terminal_report(bench, rows))
    if args.out is not None:
        written = write_outputs(bench, rows, args.out)
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if args.json:
        emit_json(payload(bench, rows))
    return 0
