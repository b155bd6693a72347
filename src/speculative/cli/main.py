"""`speculative` command line: subcommands registered from their own modules."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from speculative import __version__
from speculative.cli import (
    bench_cmd,
    bench_serve_cmd,
    chat_cmd,
    check_cmd,
    demo_cmd,
    generate_cmd,
    profile_cmd,
    serve_cmd,
    simulate_cmd,
    theory_cmd,
    train_draft_cmd,
)
from speculative.cli.common import EXIT_USAGE, CliError, Formatter, Parser

DESCRIPTION = """\
Lossless speculative decoding: a cheap drafter proposes γ tokens, the target model scores
them all in one pass, and modified rejection sampling keeps or replaces them so the output
is distributed exactly as the target's own samples.
"""


def build_parser() -> Parser:
    parser = Parser(prog="speculative", description=DESCRIPTION, formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"speculative {__version__}")
    subparsers = parser.add_subparsers(
        title="commands", metavar="COMMAND", parser_class=Parser, required=True
    )
    for command in (
        theory_cmd,
        simulate_cmd,
        generate_cmd,
        chat_cmd,
        demo_cmd,
        profile_cmd,
        bench_cmd,
        check_cmd,
        train_draft_cmd,
        serve_cmd,
        bench_serve_cmd,
    ):
        command.add_parser(subparsers)
    return parser


def quiet_libraries() -> None:
    """Our own messages say what is loading; silence transformers' per-tensor bars."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_libraries()
    try:
        return int(args.run(args))
    except (CliError, ValueError) as exc:
        print(f"speculative: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("speculative: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
