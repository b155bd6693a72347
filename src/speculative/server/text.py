"""Incremental detokenization with exact stop strings, token by token.

:class:`TextAssembler` receives each round's tokens (with how each was made) and returns
the text that is now final, as pieces ``(text, kind)``: one per token that produced it.
It keeps the generated prefix's text after each token (an
:class:`~speculative.detokenize.IncrementalDecoder`: a window decoded, not the whole
prefix) and emits only the delta that can no longer change:
  - a decoded prefix ending in U+FFFD (an incomplete UTF-8 sequence, or a piece the
    tokenizer merges with the next) is held back until later tokens complete it;
  - text that could be the start of a stop string is held back until it either is not
    (then emitted) or is (then cut: the stop string and what follows are never sent).
The concatenated pieces equal ``StopCriteria.final_text(decode(all tokens))``, the text
``speculative generate`` prints, whatever the chunk boundaries.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from speculative.detokenize import REPLACEMENT, IncrementalDecoder
from speculative.engine.loop import Round
from speculative.engine.stopping import find_stop

# how a token was made
ACCEPTED = "accepted"  # a drafted token the target accepted
RECOVERED = "recovered"  # the target's replacement for the first rejected draft
BONUS = "bonus"  # the target's extra token after a fully accepted draft
TARGET = "target"  # plain decoding: nothing was drafted this round


def token_kinds(round_: Round) -> list[str]:
    """How each of a round's emitted tokens was made."""
    kinds = []
    for i in range(len(round_.tokens)):
        if i < round_.num_accepted:
            kinds.append(ACCEPTED)
        elif round_.drafted == 0:
            kinds.append(TARGET)
        elif round_.num_accepted < round_.drafted:
            kinds.append(RECOVERED)
        else:
            kinds.append(BONUS)
    return kinds


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


@dataclass
class TextAssembler:
    """The final text of a generation, released piece by piece (see module docstring)."""

    decode: Callable[[Sequence[int]], str]
    stops: tuple[str, ...] = ()
    # where a reply's function calls start in a text (None: not there), and how many
    # characters at its end may yet start them: the text before the calls is the reply's
    calls: Callable[[str], tuple[int | None, int]] | None = None
    stop_tokens: frozenset[int] = frozenset()  # tokens whose text ends the final text
    include_stops: bool = False  # the stop string or stop token's text stays in it
    quiet: int = 0  # first tokens whose text no stop string may end in (min_tokens - 1)
    kinds: list[str] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # stable text length after token i
    text: str = ""  # decoded text of all tokens so far
    sent: int = 0  # characters of ``text`` already released
    decoder: IncrementalDecoder = field(init=False)
    token_cut: int | None = field(default=None, init=False)  # where a stop token's text starts

    def __post_init__(self) -> None:
        self.decoder = IncrementalDecoder(self.decode)

    @property
    def tokens(self) -> list[int]:
        return self.decoder.tokens

    def push(self, tokens: Sequence[int], kinds: Sequence[str]) -> list[tuple[str, str]]:
        """Add tokens; returns the newly final pieces (text, kind)."""
        for token, kind in zip(tokens, kinds, strict=True):
            if token in self.stop_tokens and self.token_cut is None:
                self.token_cut = self.ends[-1] if self.ends else 0
            self.kinds.append(kind)
            self.text = self.decoder.add(token)
            stable = len(self.text.rstrip(REPLACEMENT))
            self.ends.append(max(stable, self.ends[-1] if self.ends else 0))
        limit = self.ends[-1] if self.ends else 0
        stop = self._first_cut(self.text[:limit])
        if stop is not None:
            limit = stop
        else:
            limit -= self._held(self.text[:limit])
        return self._release(limit)

    def finish(self) -> list[tuple[str, str]]:
        """The rest of the text, cut before the first stop string."""
        self._verify()
        stop = self._first_cut(self.text)
        limit = len(self.text) if stop is None else stop
        if self.ends:
            self.ends[-1] = max(self.ends[-1], len(self.text))
        return self._release(limit)

    def final_text(self) -> str:
        self._verify()
        stop = self._first_cut(self.text)
        return self.text if stop is None else self.text[:stop]

    def offset(self, i: int) -> int:
        """Where token i's text starts in the text (its ``text_offset``)."""
        return self.ends[i - 1] if i > 0 else 0

    def settled_tokens(self) -> int:
        """Leading tokens whose text is all released (their log-probabilities can go)."""
        settled = bisect.bisect_right(self.ends, self.sent)  # ends never decrease
        return min(settled, self.final_tokens())  # never a token after a stop string

    def final_tokens(self) -> int:
        """Tokens of the final text: all of them, or those that start before a stop
        string (the stop string and what follows it are never sent)."""
        stop = self._first_cut(self.text)
        if stop is None:
            return len(self.tokens)
        if not self.tokens or stop == 0:
            return 0
        # token 0 starts at 0; token i > 0 at ends[i - 1] (ends never decrease)
        return 1 + min(bisect.bisect_left(self.ends, stop), len(self.tokens) - 1)

    def reply_text(self, final: bool) -> str:
        """The reply before its first stop string or stop token, function calls
        included (what the calls are read from): whole characters, and until ``final``
        without what may start a stop string."""
        view = self.text if final else self.text[: self.ends[-1] if self.ends else 0]
        cut = self._first_cut(view, calls=False)
        if cut is not None:
            return view[:cut]
        return view if final else view[: len(view) - partial_stop_length(view, self.stops)]

    def _first_cut(self, text: str, calls: bool = True) -> int | None:
        """Where the final text ends in ``text``: at its first stop string (after it,
        with ``include_stops``), stop token or (``calls``) function call, if any."""
        found = find_stop(text, self.stops, self._quiet_chars(text)) if self.stops else None
        cuts = [None if found is None else found[1] if self.include_stops else found[0]]
        cuts.append(self.calls(text)[0] if calls and self.calls is not None else None)
        if not self.include_stops and self.token_cut is not None and self.token_cut <= len(text):
            cuts.append(self.token_cut)
        found = [cut for cut in cuts if cut is not None]
        return min(found) if found else None

    def _quiet_chars(self, text: str) -> int:
        """Characters of ``text`` no stop string may end in: the first ``quiet`` tokens'
        (all of it until they have come)."""
        if self.quiet <= 0:
            return 0
        return self.ends[self.quiet - 1] if len(self.ends) >= self.quiet else len(text)

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that may yet start a stop string or a call."""
        held = partial_stop_length(text, self.stops)
        return max(held, self.calls(text)[1]) if self.calls is not None else held

    def _verify(self) -> None:
        """The text checked against the tokens' whole decoding (once per length)."""
        self.decoder.verify()
        self.text = self.decoder.text

    def _release(self, limit: int) -> list[tuple[str, str]]:
        pieces: list[tuple[str, str]] = []
        first = bisect.bisect_right(self.ends, self.sent)  # the first token not all sent
        start = self.ends[first - 1] if first > 0 else 0
        for end, kind in zip(self.ends[first:], self.kinds[first:], strict=True):
            lo, hi = max(start, self.sent), min(end, limit)
            if hi > lo:
                pieces.append((self.text[lo:hi], kind))
            start = end
            if start >= limit:
                break
        self.sent = max(self.sent, limit)
        return pieces


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (which decoding leaves out)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    flagged = {token_id for token_id, token in added.items() if getattr(token, "special", False)}
    return frozenset(flagged) | frozenset(tokenizer.all_special_ids)


def decode_keeping(tokenizer: Any, kept: frozenset[int]) -> Callable[[Sequence[int]], str]:
    """A decode that leaves out special tokens except ``kept`` (a reply's thinking tags
    or call opener, where they are special: its text then shows where the thinking ends
    or the calls start)."""
    dropped = special_ids(tokenizer) - kept

    def decode(token_ids: Sequence[int]) -> str:
        kept_ids = [token for token in token_ids if token not in dropped]
        return tokenizer.decode(kept_ids, skip_special_tokens=False)

    return decode
