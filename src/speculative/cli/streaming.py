"""Print generated text as it is produced, colouring where each piece came from."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from speculative.detokenize import IncrementalDecoder
from speculative.engine import Round

ACCEPTED = "\033[32m"  # green: drafted tokens the target accepted
TARGET = "\033[36m"  # cyan: recovered or bonus tokens produced by the target
RESET = "\033[0m"
DIM = "\033[2m"


def use_colour(stream: TextIO, requested: bool | None = None) -> bool:
    """Colour only on a terminal, unless NO_COLOR is set or the user decided."""
    if requested is not None:
        return requested
    return stream.isatty() and "NO_COLOR" not in os.environ


def legend(colour: bool) -> str:
    if not colour:
        return ""
    return (
        f"{ACCEPTED}accepted draft tokens{RESET} · {TARGET}target tokens (recovered/bonus){RESET}"
    )


class TextStreamer:
    """Turns rounds into text deltas; holds back text that a stop string may still claim."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        finalize: Callable[[str, Sequence[int]], str],
        stop_strings: Sequence[str] = (),
        out: TextIO = sys.stdout,
        colour: bool = False,
        speculative: bool = True,
    ) -> None:
        self.decoder = IncrementalDecoder(decode)  # the text of the tokens so far
        self.finalize = finalize
        self.stop_strings = tuple(stop_strings)
        self.out = out
        self.colour = colour and speculative
        self.printed = 0
        self.shown = ""  # the text written so far

    def push(self, round_: Round) -> None:
        accepted = round_.tokens[: round_.num_accepted]  # then the target's own tokens
        made = round_.tokens[round_.num_accepted :]
        boundary = len(self.finalize(self.decoder.extend(accepted), self.decoder.tokens))
        self.decoder.extend(made)
        if round_.finished:
            self.decoder.verify()
        text = self.finalize(self.decoder.text, self.decoder.tokens)
        end = len(text) if round_.finished else len(text) - self._holdback(text)
        self._write(text, boundary, end)

    def _holdback(self, text: str) -> int:
        """Characters at the end that may still change: a partial UTF-8 character or the
        start of a stop string."""
        hold = 1 if text.endswith("\ufffd") else 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def _write(self, text: str, boundary: int, end: int) -> None:
        if end <= self.printed:
            return
        start = self.printed
        split = min(max(boundary, start), end)
        if self.colour:
            pieces = [(ACCEPTED, text[start:split]), (TARGET, text[split:end])]
            self.out.write("".join(f"{c}{s}{RESET}" for c, s in pieces if s))
        else:
            self.out.write(text[start:end])
        self.out.flush()
        self.printed = end
        self.shown = text[:end]
