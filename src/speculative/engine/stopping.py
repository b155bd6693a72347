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


@dataclass
class StopCriteria:
    """When to stop. ``decode`` turns generated token ids into text (for stop strings)."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[Sequence[int]], str] | None = None

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
        if self.find_stop(self.decode(window)) is not None:
            return 0
        for i in range(1, len(new) + 1):
            if self.find_stop(self.decode([*window, *new[:i]])) is not None:
                return i
        return None

    def find_stop(self, text: str) -> int | None:
        """Index where the earliest stop string starts in ``text``, or None."""
        hits = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        return min(hits) if hits else None

    def final_text(self, text: str) -> str:
        """The output text, cut just before the first stop string (which is not included)."""
        index = self.find_stop(text) if self.stop_strings else None
        return text if index is None else text[:index]
