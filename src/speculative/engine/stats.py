"""Counters of a generation: what was drafted, accepted, recovered and emitted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PositionAcceptance:
    """Per drafted position i + 1: ``reached[i]`` counts the rounds that examined it (every
    draft before it accepted), ``accepted[i]`` those that accepted it. Kept by a
    generation's stats, summed over a bench's prompts and exported by the server."""

    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, drafted: int, num_accepted: int) -> int:
        """One round that drafted ``drafted`` tokens and accepted ``num_accepted``;
        returns how many positions it examined."""
        examined = min(drafted, num_accepted + 1)
        self._grow(drafted)
        for i in range(examined):
            self.reached[i] += 1
            self.accepted[i] += int(i < num_accepted)
        return examined

    def merge(self, other: PositionAcceptance) -> None:
        """Add ``other``'s counts position by position."""
        self._grow(len(other.reached))
        for i, (r, a) in enumerate(zip(other.reached, other.accepted, strict=True)):
            self.reached[i] += r
            self.accepted[i] += a

    def rate(self, i: int) -> float:
        """Acceptance at position i + 1 (0 where never reached)."""
        return self.accepted[i] / self.reached[i] if self.reached[i] else 0.0

    def rates(self) -> list[float]:
        return [self.rate(i) for i in range(len(self.reached))]

    def _grow(self, positions: int) -> None:
        while len(self.reached) < positions:
            self.reached.append(0)
            self.accepted.append(0)


@dataclass
class GenerationStats:
    """Running statistics; only emitted tokens are counted as output.

    target_calls: verification passes of the target (one per round; prefill excluded).
    positions: per-position acceptance (:class:`PositionAcceptance`).
    draft_seconds: wall time in the drafter's propose calls (its catch-up included).
    cached_prompt_tokens: prompt tokens the row's cache already held when it started (a
    previous generation's or another row's), not computed again.
    """

    target_calls: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    cached_prompt_tokens: int = 0
    positions: PositionAcceptance = field(default_factory=PositionAcceptance)
    gammas: list[int] = field(default_factory=list)

    def add(self, other: GenerationStats) -> None:
        """Add ``other``'s counts, seconds and rounds to these (generations one after
        another); positions merged."""
        self.target_calls += other.target_calls
        self.draft_calls += other.draft_calls
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds
        self.prefill_seconds += other.prefill_seconds
        self.draft_seconds += other.draft_seconds
        self.cached_prompt_tokens += other.cached_prompt_tokens
        self.positions.merge(other.positions)
        self.gammas += other.gammas

    @classmethod
    def together(cls, parts: Sequence[GenerationStats]) -> GenerationStats:
        """Generations that ran side by side (rows of one batch) as one: :meth:`add`ed,
        but the seconds those of the longest."""
        out = cls()
        for part in parts:
            out.add(part)
        out.seconds = max((part.seconds for part in parts), default=0.0)
        out.prefill_seconds = max((part.prefill_seconds for part in parts), default=0.0)
        return out

    def record_round(self, drafted: int, num_accepted: int, emitted: int) -> None:
        """One verification round: ``drafted`` proposed, ``num_accepted`` kept, ``emitted``
        tokens actually output (after any stop cut)."""
        self.target_calls += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += min(num_accepted, emitted)
        self.new_tokens += emitted
        self.gammas.append(drafted)
        self.positions.record(drafted, num_accepted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ: emitted tokens per target call, the recovered/bonus token included."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return self.positions.rates()

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_acceptance,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "tokens_per_second": self.tokens_per_second,
            "mean_gamma": sum(self.gammas) / len(self.gammas) if self.gammas else 0.0,
        }
