"""Sampling parameters and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution; applied identically to target and draft.

    temperature: 0 selects the argmax branch (greedy), otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 disables).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1 disables).
    min_p: keep the tokens at least min_p times as likely as the likeliest (0 disables):
        a tempered logit at least the largest + ln(min_p), after top-k, before top-p.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, int | float) or math.isnan(self.temperature):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if math.isinf(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if (
            not isinstance(self.top_p, int | float)
            or math.isnan(self.top_p)
            or not 0 < self.top_p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if (
            isinstance(self.min_p, bool)
            or not isinstance(self.min_p, int | float)
            or math.isnan(self.min_p)
            or not 0 <= self.min_p < 1
        ):
            raise ValueError(f"min_p must be in [0, 1) (0 disables), got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
