"""`speculative chat`: a conversation with the model in the terminal, each reply streamed
with speculative decoding and followed by its statistics."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from speculative.cli.common import CliError, Formatter, emit_json
from speculative.cli.generate_cmd import (
    add_colour_arguments,
    add_decoding_arguments,
    add_model_arguments,
    add_tree_argument,
    check_decoding,
    drafters_description,
    gamma_text,
    load_speculator,
    stats_line,
)
from speculative.cli.streaming import TextStreamer, use_colour

if TYPE_CHECKING:
    from speculative.pipeline import GenerationOutput, Speculator

DESCRIPTION = """\
Talk with the model: type a message, the reply streams back (green: accepted draft tokens,
cyan: target tokens), then a line of statistics (tokens per second, τ, α, and how many
prompt tokens the turn had to compute). Every reply is exactly what the target alone would
write: at temperature 0 its greedy text, otherwise its sample (turn n uses seed + n).

The conversation goes through the model's chat template each turn. The model's cache
keeps the conversation so far, so a turn computes only its new message: earlier turns are
not computed again.

Commands:
  /system TEXT   set the system message (starts a new conversation); /system alone shows it
  /undo          forget the last exchange
  /reset         start a new conversation
  /help          this list
  /exit, /quit   leave (or Ctrl-D). Ctrl-C stops a reply; the text so far stays in the
                 conversation.

Example:  speculative chat --temperature 0.7 --system "Answer in one sentence."
"""
HELP = """\
/system TEXT  set the system message (a new conversation); /system alone shows it
/undo         forget the last exchange
/reset        start a new conversation
/exit, /quit  leave (or Ctrl-D); Ctrl-C stops a reply"""
PROMPT = "> "


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="talk with the model in the terminal, replies streamed with speculation",
        description=DESCRIPTION + drafters_description(),
        formatter_class=Formatter,
    )
    parser.add_argument("--system", default=None, help="system message (default: the template's)")
    add_model_arguments(parser)
    add_tree_argument(parser)
    add_decoding_arguments(parser, budget=256, budget_help="token budget of each reply")
    add_colour_arguments(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="for scripts: each reply as one JSON line (text, finish reason, statistics) "
        "instead of streamed text, and no statistics lines",
    )
    parser.set_defaults(run=run)


@dataclass
class Conversation:
    """The messages so far; the system message, if any, first."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)  # user, assistant, …

    def messages(self) -> list[dict[str, str]]:
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return head + self.turns

    def undo(self) -> bool:
        """Forget the last exchange (a user message and its reply); False: none."""
        if not self.turns:
            return False
        del self.turns[-2:]
        return True


@dataclass
class ChatLoop:
    """Reads messages and commands, writes replies (``out``) and statistics (``err``)."""

    speculator: Speculator
    options: dict[str, Any]  # Speculator.stream's keyword arguments
    read: Callable[[], str | None]  # the next line; None at the end of the input
    out: TextIO
    err: TextIO
    colour: bool
    as_json: bool
    conversation: Conversation = field(default_factory=Conversation)
    turn: int = 0

    def run(self) -> None:
        while True:
            try:
                line = self.read()
            except KeyboardInterrupt:
                self.err.write("\n(Ctrl-D or /exit to leave)\n")
                continue
            if line is None:
                return
            line = line.strip()
            if line.startswith("/"):
                if not self.command(line):
                    return
            elif line:
                self.reply(line)

    def command(self, line: str) -> bool:
        """Run a /command; False: leave."""
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.conversation.turns.clear()
            self._note("(a new conversation)")
        elif name == "/undo":
            self._note("(the last exchange is forgotten)" if self.conversation.undo() else
                       "(nothing to undo)")  # fmt: skip
        elif name == "/system" and rest.strip():
            self.conversation = Conversation(rest.strip())
            self._note("(system message set: a new conversation)")
        elif name == "/system":
            self._note(f"(system message: {self.conversation.system or 'the template default'})")
        elif name == "/help":
            self._note(HELP)
        else:
            self._note(f"(unknown command {name}; /help lists them)")
        return True

    def reply(self, message: str) -> None:
        """Answer ``message`` (streamed); the exchange joins the conversation."""
        conversation = self.conversation
        conversation.turns.append({"role": "user", "content": message})
        options = {**self.options, "seed": self.options["seed"] + self.turn}
        stopped, stream, printer = False, None, None
        try:
            stream = self.speculator.stream(messages=conversation.messages(), chat=True, **options)
            printer = TextStreamer(
                self.speculator.decode, stream.criteria.final_text, options["stop"], self.out,
                self.colour and not self.as_json, speculative=self.speculator.drafter is not None,
            )  # fmt: skip
            for round_ in stream:
                if not self.as_json:
                    printer.push(round_)
        except KeyboardInterrupt:  # inside a round, maybe: the cache is not to be trusted
            self.speculator.forget_cache()
            stopped = True
        except ValueError as exc:  # the conversation outgrew the context, …
            conversation.turns.pop()
            self._note(f"error: {exc} (/undo or /reset makes room)")
            return
        if stream is None:  # stopped before the reply began
            conversation.turns.pop()
            self._note("(stopped)")
            return
        self.turn += 1
        output = stream.output()
        # a stopped reply keeps what was shown (the last round may not have been)
        shown = printer.shown if stopped and printer is not None and not self.as_json else None
        reply = output.text if shown is None else shown
        conversation.turns.append({"role": "assistant", "content": reply})
        prompt = len(stream.prompt_ids)
        self._report(output, stopped, prompt, prompt - output.stats.cached_prompt_tokens)

    def _report(self, output: GenerationOutput, stopped: bool, prompt: int, computed: int) -> None:
        reason = "stopped" if stopped else output.finish_reason
        if self.as_json:
            record = {
                "text": output.text,
                "finish_reason": reason,
                "prompt_tokens": prompt,
                "computed_prompt_tokens": computed,
                "stats": output.stats.to_dict(),
            }
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()
            return
        self.out.write("\n")
        self.out.flush()
        draft = self.speculator.drafter.name if self.speculator.drafter is not None else "none"
        note = f"prompt {prompt} tokens, {computed} computed"
        self.err.write(stats_line(output.stats.to_dict(), self.colour, draft, note) + "\n")
        if stopped:
            self.err.write("(stopped)\n")

    def _note(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()


def _reader() -> Callable[[], str | None]:
    """Lines from the terminal (with line editing and a prompt) or from piped input."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):  # not every platform has it
            import readline  # noqa: F401  (line editing and history for input())

        def ask() -> str | None:
            try:
                return input(PROMPT)
            except EOFError:
                print(file=sys.stderr)
                return None

        return ask

    def piped() -> str | None:
        line = sys.stdin.readline()
        return line if line else None

    return piped


def run(args: argparse.Namespace) -> int:
    check_decoding(args)
    speculator = load_speculator(args)
    if not getattr(speculator.target.tokenizer, "chat_template", None):
        raise CliError("chat needs a model whose tokenizer has a chat template; this one has none")
    colour = use_colour(sys.stdout, args.colour)
    draft = speculator.drafter.name if speculator.drafter is not None else "none"
    if not args.json:
        print(
            f"speculative chat · {args.target} · draft {draft} · γ {gamma_text(args)} — "
            "/help for commands, Ctrl-D to leave",
            file=sys.stderr,
        )
    loop = ChatLoop(
        speculator,
        {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "min_p": args.min_p,
            "seed": args.seed,
            "stop": (),
            "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty,
            "repetition_penalty": args.repetition_penalty,
            "min_tokens": args.min_tokens,
        },
        _reader(),
        sys.stdout,
        sys.stderr,
        colour,
        args.json,
        Conversation(args.system),
    )
    loop.run()
    if args.json:
        emit_json({"turns": loop.turn, "messages": loop.conversation.messages()})
    return 0
