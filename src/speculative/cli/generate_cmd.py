"""`speculative generate`: speculative text generation with a real model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculative.cli.common import (
    CliError,
    Formatter,
    add_json_flag,
    emit_json,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from speculative.cli.streaming import DIM, RESET, TextStreamer, legend, use_colour
from speculative.drafters.tree import TREE_MODES

if TYPE_CHECKING:
    from speculative.sampling.penalties import Penalties

DESCRIPTION = """\
Generate text with lossless speculative decoding.

A drafter proposes γ tokens; the target scores them in one pass; each drafted token is
accepted with probability min(1, p/q), the first rejected one is replaced by a recovered
token from normalize(max(0, p − q)), and a fully accepted round earns a bonus token. The
output is distributed exactly as the target's own samples (at temperature 0: identical to
greedy decoding).

Drafters (--draft): listed at the end of this text, from the drafter registry.

Token trees (--tree; model drafters and ngram): draft a tree of candidates instead of one chain,
verify every node in one target pass with a tree attention mask, and keep the longest
accepted path (siblings are tested by recursive rejection sampling, still lossless):
  off       chains of γ drafted tokens
  static    a fixed shape: 2 children at the first two depths, then 1
  dynamic   grow the draft's likeliest path, with runner-up candidates where it is
            unsure (EAGLE-2 style ranking, calibrated online)
--tree-budget caps the nodes per tree (auto: sized from the measured verify-cost curve).

Batched jobs (--prompts FILE.jsonl --out results.jsonl): every line of FILE is a prompt,
decoded by the batched engine (native runtime); results go to --out in input order, and rows
already there are skipped, so a crashed job resumes. FILE may instead hold OpenAI batch
requests (custom_id, url /v1/chat/completions or /v1/completions, body), as uploaded to
OpenAI's Batch API: --out then gets OpenAI's batch output lines. --ray [ADDRESS]
--workers N splits the rows over N Ray actors (each loads the target once and batches its
share), on a local Ray instance or a cluster (ray://HOST:10001, or RAY_ADDRESS).

Example:  speculative generate "Why is the sky blue?" --draft auto --max-new-tokens 64
Fill in the middle (code models):  speculative generate --target FOLDER --no-chat \
          "def area(r):\n    return " --suffix "\n\nprint(area(2))"

On a terminal, green text came from accepted draft tokens and cyan text from the target
(recovered or bonus tokens). A stats line follows on stderr.
"""


def add_model_arguments(
    parser: argparse.ArgumentParser,
    draft_default: str | None = "default",
    draft_help: str = "drafter (see above; 'default': auto where an EAGLE head ships for the "
    "target, else ngram)",
) -> None:
    parser.add_argument(
        "--target",
        default="default",
        help="target model: 'default' (SmolLM2-135M-Instruct), a folder, a .gguf or a hub id",
    )
    parser.add_argument("--draft", default=draft_default, help=draft_help)
    parser.add_argument(
        "--runtime",
        choices=["auto", "hf", "native"],
        default="auto",
        help="model runtime: native (Llama family), hf (transformers), auto picks",
    )
    parser.add_argument(
        "--precision",
        default="auto",
        help="target weight precision: auto (the model's own: a Q4 GGUF runs int4 as "
        "stored, bf16 checkpoints bf16, else fp32), fp32, bf16; native also int8, int4. "
        "Speculation is exact with respect to the target at this precision",
    )
    add_kv_cache_argument(parser)
    add_max_context_argument(parser)


def add_max_context_argument(parser: argparse.ArgumentParser) -> None:
    """``--max-context``: the context window a command loads the target with."""
    parser.add_argument(
        "--max-context",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="context window in tokens, prompt and output together (default: the model's "
        "own, 8192 for SmolLM2; the native runtime stops at a model's sliding window). The "
        "native KV cache grows with the text, so a long window costs memory only when used",
    )


def add_kv_cache_argument(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """``--kv-cache``; ``several``: a list of them, measured side by side (profile)."""
    parser.add_argument(
        "--kv-cache",
        nargs="+" if several else None,
        choices=["auto", "fp32", "fp16"],
        default=["auto"] if several else "auto",
        help="KV cache of the native runtime: auto (fp32 for an fp32 target, else fp16, as "
        "llama.cpp keeps it), fp32, or fp16 (keys and values rounded to half once when "
        "stored: half the bytes attention reads each step; speculation stays exact "
        "with respect to the target as it runs)"
        + ("; several are measured side by side (a long --context shows it)" if several else ""),
    )


def add_tree_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tree",
        choices=TREE_MODES,
        default="off",
        help="draft token trees instead of chains (see above)",
    )
    parser.add_argument(
        "--tree-budget",
        type=tree_budget,
        default=6,
        help="most tree nodes per round, or 'auto' (from the measured verify-cost curve)",
    )


def tree_budget(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def add_colour_arguments(parser: argparse.ArgumentParser) -> None:
    """--color / --no-color (default: colours on a terminal, unless NO_COLOR is set)."""
    parser.add_argument(
        "--color", dest="colour", action="store_true", default=None, help="force colours"
    )
    parser.add_argument("--no-color", dest="colour", action="store_false", help="no colours")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """How to decode (:func:`add_decoding_arguments`) and what each output holds
    (:func:`add_output_arguments`)."""
    add_decoding_arguments(parser)
    add_output_arguments(parser)


def add_decoding_arguments(
    parser: argparse.ArgumentParser, budget: int = 128, budget_help: str | None = None
) -> None:
    """γ, the sampling parameters, the token budget, the seed and the penalties."""
    parser.add_argument(
        "--gamma",
        default=None,
        help="drafted tokens per round, 'auto' (γ from measured costs: the adaptive policy; "
        "a drafter that picks its own length, like --draft auto, gets the measured "
        "verify-cost curve and a cap of 8 instead; with --prompts, every row's γ chosen "
        "for the load each round, 0 where a draft no longer pays) or 'heuristic' "
        "(transformers' +2/−1 schedule). Default: 4 for one prompt, auto with --prompts "
        "(a fixed γ keeps drafting as the batch fills, where it loses to plain decoding)",
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 = greedy (argmax); otherwise sample from softmax(logits / T)",
    )
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1: off)")
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="keep tokens at least this times as likely as the likeliest, in [0, 1) (0: off)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=non_negative_int,
        default=budget,
        help=budget_help or "token budget (0, with --prompt-logprobs: only score the prompt)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="hold end-of-sequence back until the output has this many tokens (exact "
        "under speculation); a --stop string inside them does not count (vLLM's)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=positive_float,
        default=1.0,
        help="divide (multiply, if negative) the logits of tokens already in the prompt or "
        "output by this (1: off; exact under speculation, as every penalty)",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract this times a token's count in the output from its logit (0: off)",
    )
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract this from the logits of tokens already in the output (0: off)",
    )


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Log-probabilities and output formats (JSON schema, regex, choice, grammar)."""
    parser.add_argument(
        "--logprobs",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="with --json (or --prompts' JSONL): each generated token's log-probability "
        "under the target's raw distribution (before temperature, top-k, top-p) and its N "
        "likeliest alternatives; speculation does not change them",
    )
    formats = parser.add_mutually_exclusive_group()
    formats.add_argument(
        "--json-schema",
        type=json_schema_argument,
        default=None,
        metavar="SCHEMA",
        help="write JSON that satisfies this JSON schema (inline JSON, a file's path, or "
        "'object' for any JSON object): the target is restricted to tokens that keep the "
        "output valid (a grammar; speculation stays exact for the restricted target)",
    )
    formats.add_argument(
        "--regex", default=None, help="write text that matches this regular expression in full"
    )
    formats.add_argument(
        "--choice", nargs="+", default=None, metavar="TEXT", help="write exactly one of these"
    )
    formats.add_argument(
        "--grammar",
        type=lark_grammar_argument,
        default=None,
        metavar="FILE",
        help="write a sentence of this Lark grammar (a file; llguidance's Lark dialect)",
    )
    parser.add_argument(
        "--prompt-logprobs",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="with --json (or --prompts' JSONL): the same for each prompt token after the "
        "first, given the tokens before it (with --max-new-tokens 0: score the prompt only)",
    )


def json_schema_argument(text: str) -> dict:
    """--json-schema: inline JSON, a file holding it, or "object" (any JSON object)."""
    import json

    from speculative.structured.grammar import ANY_OBJECT

    if text == "object":
        return dict(ANY_OBJECT)
    source = text
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise argparse.ArgumentTypeError(
                f"{text!r} is neither a JSON object, a file, nor 'object'"
            )
        source = path.read_text()
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError("a JSON schema is a JSON object")
    return schema


def lark_grammar_argument(text: str) -> str:
    """--grammar: a file holding a Lark grammar."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no grammar file {text!r}")
    return path.read_text()


def output_format_of(args: argparse.Namespace) -> Any:
    """The --json-schema / --regex / --choice / --grammar option as a structured
    ``OutputFormat`` (None: free text)."""
    from speculative.structured import OutputFormat

    return OutputFormat.given(args.json_schema, args.regex, args.choice, args.grammar)


def drafters_description() -> str:
    from speculative.drafters.registry import drafter_help

    return "\nDrafters (--draft), from the registry:\n" + drafter_help()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description=DESCRIPTION + drafters_description(),
        formatter_class=Formatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "text", nargs="?", metavar="PROMPT", help="prompt text (or --prompt / --prompt-file)"
    )
    source.add_argument("--prompt", help="prompt text (the same as PROMPT)")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    parser.add_argument(
        "--prediction-file",
        type=Path,
        help="text the output is expected to resemble (a file you ask the model to edit): "
        "drafted from instead of --draft, as OpenAI's Predicted Outputs; exact whatever "
        "it says (a wrong prediction only costs rejected drafts)",
    )
    parser.add_argument(
        "--suffix",
        help="fill in the middle: generate the text between the prompt and this suffix "
        "(a raw prompt, through the model's fill-in-the-middle tokens, as code models "
        "such as StarCoder, Qwen2.5-Coder and DeepSeek-Coder have; not the default model)",
    )
    source.add_argument(
        "--prompts",
        type=Path,
        help="JSONL file of prompts (prompt or messages; optional temperature, top_k, top_p, "
        "min_p, "
        "seed, max_new_tokens, stop, presence_penalty, frequency_penalty, repetition_penalty, "
        "json_schema, regex, choice, grammar; or OpenAI batch requests), "
        "decoded in batches (native runtime); needs --out",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=8, help="--prompts: rows decoded together"
    )
    parser.add_argument(
        "--out", type=Path, help="--prompts: results JSONL (rows already there are skipped)"
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="--prompts: spread the rows over Ray workers. No ADDRESS: a local instance (or "
        "the cluster RAY_ADDRESS names); ray://HOST:10001 a remote cluster; auto the cluster "
        "this machine belongs to. Needs the extra: pip install 'speculative[ray]'",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="--ray: Ray actors, each loading the target once and batching its share",
    )
    parser.add_argument(
        "--worker-cpus",
        type=positive_int,
        default=1,
        help="--ray: CPUs reserved (and torch threads) per worker",
    )
    chat = parser.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="wrap the prompt in the model's chat template (default if it has one)",
    )
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the raw prompt")
    add_model_arguments(parser)
    add_tree_argument(parser)
    add_sampling_arguments(parser)
    parser.add_argument(
        "--stop",
        nargs="+",
        default=[],
        metavar="STRING",
        help="stop when the output contains one of these strings",
    )
    add_colour_arguments(parser)
    add_json_flag(parser)
    parser.set_defaults(run=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt if args.prompt is not None else args.text
    text = read_text_file(args.prompt_file, "--prompt-file")
    assert text is not None
    return text


def read_text_file(path: Path | None, flag: str) -> str | None:
    """The text of the file a flag names (None: none named); a one-line error if unreadable."""
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError as exc:
        raise CliError(f"cannot read {flag} {path}: {exc.strerror}") from None


def gamma_text(args: argparse.Namespace) -> str:
    """--gamma as given, else the mode's default: 4 for one prompt, "auto" (load-aware)
    for a file of prompts decoded in batches."""
    if args.gamma is not None:
        return args.gamma
    return "auto" if getattr(args, "prompts", None) is not None else "4"


def check_decoding(args: argparse.Namespace) -> None:
    """γ, the sampling parameters and the penalties, checked before anything loads
    (ValueError naming a bad one)."""
    from speculative.engine.gamma import parse_gamma
    from speculative.sampling import SamplingParams

    parse_gamma(gamma_text(args))
    SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    penalties_of(args)


def load_speculator(args: argparse.Namespace):
    from speculative.engine.gamma import parse_gamma
    from speculative.pipeline import Speculator

    gamma = parse_gamma(gamma_text(args))
    return Speculator.load(
        args.target,
        args.draft,
        gamma,
        args.runtime,
        args.precision,
        args.tree,
        args.tree_budget,
        kv_cache=args.kv_cache,
        max_context=args.max_context,
    )


def generation_kwargs(args: argparse.Namespace) -> dict:
    return {
        "chat": args.chat,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop,
        "logprobs": args.logprobs,
        "prompt_logprobs": args.prompt_logprobs,
        "json_schema": args.json_schema,
        "regex": args.regex,
        "choice": args.choice,
        "grammar": args.grammar,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repetition_penalty,
        "min_tokens": args.min_tokens,
    }


def penalties_of(args: argparse.Namespace) -> Penalties:
    """The --*-penalty options (ValueError naming a bad one)."""
    from speculative.sampling.penalties import Penalties

    return Penalties(
        args.presence_penalty, args.frequency_penalty, args.repetition_penalty,
        min_tokens=args.min_tokens,
    )  # fmt: skip


def stats_line(stats: dict, colour: bool, draft: str | None = None, extra: str = "") -> str:
    """The one-line summary of a generation (``draft``: the drafter's name, then
    ``extra``, shown last)."""
    line = (
        f"[{stats['new_tokens']} tokens in {stats['seconds']:.2f} s = "
        f"{stats['tokens_per_second']:.1f} tok/s · target calls {stats['target_calls']} · "
        f"τ {stats['mean_accepted_length']:.2f} tokens/call · "
        f"α {stats['acceptance_rate']:.2f} ({stats['accepted_tokens']}/{stats['drafted_tokens']})"
        + (f" · draft {draft}" if draft else "")
        + (f" · {extra}]" if extra else "]")
    )
    return f"{DIM}{line}{RESET}" if colour else line


def check_scoring(args: argparse.Namespace) -> None:
    """--max-new-tokens 0 only scores a prompt: it needs --prompt-logprobs."""
    if args.max_new_tokens == 0 and args.prompt_logprobs is None:
        raise CliError(
            "--max-new-tokens 0 generates nothing: add --prompt-logprobs N to score the "
            "prompt, or give a budget of at least 1"
        )


def run(args: argparse.Namespace) -> int:
    if args.prompts is None and args.ray is not None:
        raise CliError("--ray needs --prompts FILE.jsonl")
    check_scoring(args)
    for flag, value in (("--suffix", args.suffix), ("--prediction-file", args.prediction_file)):
        if args.prompts is not None and value is not None:
            raise CliError(f"{flag} applies to one prompt, not to --prompts")
    if args.prompts is not None:
        from speculative.cli.batch_generate import run_batch

        return run_batch(args)
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(args, name) is not None and not args.json:
            flag = "--" + name.replace("_", "-")
            raise CliError(f"{flag} shows in the --json output: add --json")
    prompt = read_prompt(args)
    if not prompt.strip():
        raise CliError("the prompt is empty")
    check_decoding(args)
    speculator = load_speculator(args)
    prediction = read_text_file(args.prediction_file, "--prediction-file")
    stream = speculator.stream(
        prompt, **generation_kwargs(args), suffix=args.suffix, prediction=prediction
    )
    colour = use_colour(sys.stdout, args.colour)
    if args.json:
        for _ in stream:
            pass
    else:
        printer = TextStreamer(
            speculator.decode,
            stream.criteria.final_text,
            args.stop,
            sys.stdout,
            colour,
            speculative=speculator.drafter is not None,
        )
        for round_ in stream:
            printer.push(round_)
        sys.stdout.write("\n")
    output = stream.output()
    draft = speculator.drafter.name if speculator.drafter is not None else "none"
    if args.json:  # which drafter ran: --draft default names one
        emit_json({**output.to_dict(), "draft": draft})
    else:
        if colour and speculator.drafter is not None:
            print(legend(colour), file=sys.stderr)
        err_colour = use_colour(sys.stderr, args.colour)
        print(stats_line(output.stats.to_dict(), err_colour, draft), file=sys.stderr)
    return 0
