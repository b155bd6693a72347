"""Exact stopping: EOS, stop strings and the token budget cut inside a block."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCut:
    """How many of a round's emitted tokens to keep, and whether generation ends."""

    keep: int
    finished: bool
    reason: str | None = None


# an engine finish reason as OpenAI's finish_reason ("context": the window ended it)
OPENAI_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def openai_finish_reason(reason: str | None) -> str:
    """OpenAI's ``finish_reason`` for an engine finish reason (the server's answers and
    the batch job's OpenAI output lines alike)."""
    return OPENAI_FINISH_REASONS.get(reason or "", "stop")


def find_stop(text: str, stops: Sequence[str], after: int = 0) -> tuple[int, int] | None:
    """(where it starts, where it ends) of the earliest stop string in ``text`` (of those
    starting earliest, the first given) among those ending after character ``after``
    (earlier ones do not count: they came within ``min_tokens``), or None."""
    hits = []
    for k, stop in enumerate(stops):
        start = text.find(stop, max(0, after - len(stop) + 1))
        if start >= 0:
            hits.append((start, k))
    if not hits:
        return None
    start, k = min(hits)
    return start, start + len(stops[k])


@dataclass
class StopCriteria:
    """When to stop. ``decode`` turns generated token ids into text (for stop strings).
    ``min_tokens`` (vLLM's): a stop string counts only where an output token at index
    ``min_tokens - 1`` or later completes it (end-of-sequence is held back by the
    penalties' ``min_tokens``, not here)."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[Sequence[int]], str] | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:  # 0: the prompt is only scored (its log-probabilities)
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        if self.stop_strings and self.decode is None:
            raise ValueError("stop strings need a tokenizer to decode the generated tokens")

    def cut(self, generated: Sequence[int], new: Sequence[int]) -> StopCut:
        """Cut for ``new`` tokens appended after ``generated`` (both exclude the prompt)."""
        budget = self.max_new_tokens - len(generated)
        keep, reason = min(len(new), budget), None
        if keep < len(new) or len(generated) + keep >= self.max_new_tokens:
            reason = "length"
        for i, token in enumerate(new[:keep]):
            if token in self.eos_token_ids:
                keep, reason = i + 1, "eos"
                break
        if self.stop_strings:
            hit = self._stop_string_cut(generated, new[:keep])
            if hit is not None:
                keep, reason = hit, "stop"
        return StopCut(keep=keep, finished=reason is not None, reason=reason)

    def _stop_string_cut(self, generated: Sequence[int], new: Sequence[int]) -> int | None:
        """Smallest number of ``new`` tokens after which the text contains a stop string.

        Only a tail of ``generated`` is decoded: a stop string of L characters spans at most
        4 L tokens (a token holds at least one byte, a character at most four), so any hit
        that involves the new tokens starts inside that window. The cost per round does not
        grow with the length of the generation.
        """
        assert self.decode is not None
        window = list(generated[-(4 * max(map(len, self.stop_strings)) + 4) :])
        # characters of window + new that no stop string may end in (min_tokens)
        quiet = self.min_tokens - 1 - (len(generated) - len(window))
        seq = [*window, *new]
        after = len(self.decode(seq[:quiet])) if quiet > 0 else 0
        if self.find_stop(self.decode(window), after) is not None:
            return 0
        for i in range(1, len(new) + 1):
            if self.find_stop(self.decode([*window, *new[:i]]), after) is not None:
                return i
        return None

    def find_stop(self, text: str, after: int = 0) -> int | None:
        """Index where the earliest stop string that ends after character ``after``
        starts in ``text``, or None."""
        found = find_stop(text, self.stop_strings, after)
        return None if found is None else found[0]

    def quiet_chars(self, token_ids: Sequence[int]) -> int:
        """Characters of the output's text no stop string may end in: the text of its
        first ``min_tokens - 1`` tokens (``token_ids``: the output so far, or all of it)."""
        if self.min_tokens <= 1 or not self.stop_strings:
            return 0
        assert self.decode is not None
        return len(self.decode(list(token_ids[: self.min_tokens - 1])))

    def final_text(self, text: str, token_ids: Sequence[int] = ()) -> str:
        """The output text, cut just before the first stop string (which is not included);
        ``token_ids``: the output's tokens, where ``min_tokens`` makes early ones not count."""
        if not self.stop_strings:
            return text
        index = self.find_stop(text, self.quiet_chars(token_ids))
        return text if index is None else text[:index]
