"""Counters of a generation: what was drafted, accepted, recovered and emitted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """Running statistics; only emitted tokens are counted as output.

    target_calls: verification passes of the target (one per round; prefill excluded).
    per-position acceptance: accepted[i] / reached[i], where ``reached[i]`` counts rounds
    whose drafted position i+1 was examined (all earlier ones accepted).
    """

    target_calls: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    gammas: list[int] = field(default_factory=list)

    def record_round(self, drafted: int, num_accepted: int, emitted: int) -> None:
        """One verification round: ``drafted`` proposed, ``num_accepted`` kept, ``emitted``
        tokens actually output (after any stop cut)."""
        self.target_calls += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += min(num_accepted, emitted)
        self.new_tokens += emitted
        self.gammas.append(drafted)
        examined = min(drafted, num_accepted + 1)
        while len(self.reached) < drafted:
            self.reached.append(0)
            self.accepted_at.append(0)
        for i in range(examined):
            self.reached[i] += 1
            self.accepted_at[i] += int(i < num_accepted)

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
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached, strict=True)]

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
            "tokens_per_second": self.tokens_per_second,
            "mean_gamma": sum(self.gammas) / len(self.gammas) if self.gammas else 0.0,
        }
