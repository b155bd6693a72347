"""``auto``: per round, draft from n-gram lookup or from a head, whichever promises more
tokens per unit of cost.

For each option the drafter keeps running estimates of its per-token acceptance α (the
n-gram option separately per match-length class: 1, 2, 3, 4–7 and 8 or more tokens of
the longest earlier match, :func:`~speculative.drafters.ngram.best_match`) and of its
draft cost c per token relative
to a verification (both measured as generation goes). A round with γ drafts is expected
to emit (1 - α^(γ+1)) / (1 - α) tokens for a cost of γ·c + 1; the option with the higher
ratio drafts, and when neither beats a plain step (1 token per unit of cost) nothing is
drafted. No fixed priority: a long match wins only while matches keep paying; the head
drafts at least every EXPLORE rounds so that its estimate stays current.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculative.drafters.base import Draft, Drafter, ReadsTargetFeatures, SupportsPriming
from speculative.drafters.ngram import SITUATION_CLASSES, best_match, match_situation
from speculative.models.session import FeatureSource, ModelSession
from speculative.sampling import SamplingParams

DECAY = 0.9  # weight of the past in the running estimates
MAX_NGRAM = 16  # the longest match compared
EXPLORE = 8  # rounds without the head after which it drafts once (keeps its α current)
WINDOW = 2048


@dataclass
class Estimate:
    """Running per-token acceptance α and draft cost c (per drafted token, in units of a
    verification)."""

    alpha: float
    cost: float

    def value(self, gamma: int) -> float:
        """Expected emitted tokens per unit of cost for a round of ``gamma`` drafts."""
        a = min(self.alpha, 0.999)
        tokens = (1 - a ** (gamma + 1)) / (1 - a)
        return tokens / (gamma * self.cost + 1.0)

    def update_alpha(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        failures = 0 if accepted >= drafted else 1
        observed = accepted / (accepted + failures)
        self.alpha = DECAY * self.alpha + (1 - DECAY) * observed

    def update_cost(self, cost: float) -> None:
        self.cost = DECAY * self.cost + (1 - DECAY) * cost


def longest_match(context: Sequence[int], gamma: int) -> tuple[int, list[int]]:
    """(the match's length class, up to ``gamma`` tokens that followed it) for the
    longest earlier match of the context's end (class 0 and no tokens: none)."""
    recent = context[-WINDOW:]
    match = best_match(recent, MAX_NGRAM)
    if match is None or gamma < 1:
        return 0, []
    return match_situation(match), [int(t) for t in recent[match.end : match.end + gamma]]


class AutoDrafter:
    """Chooses per round between n-gram lookup and ``head`` (any model-based drafter)."""

    def __init__(self, head: Drafter, name: str = "auto") -> None:
        self.name = name
        self.head = head
        self.ngram = {n: Estimate(alpha=0.5, cost=0.01) for n in SITUATION_CLASSES}
        self.model = Estimate(alpha=0.7, cost=0.15)
        self._chosen: Estimate | None = None
        self._drafted = 0
        self._proposed_at = 0.0
        self._draft_seconds = 0.0
        self.choices = {"ngram": 0, "head": 0, "none": 0}
        self._since_head = 0

    @property
    def forward_calls(self) -> int:
        return self.head.forward_calls

    def reset(self) -> None:
        self.head.reset()
        self._chosen = None
        self._since_head = 0

    def prime(self, target: ModelSession) -> None:
        if isinstance(self.head, SupportsPriming):
            self.head.prime(target)

    def read_features(self, source: FeatureSource) -> None:
        if isinstance(self.head, ReadsTargetFeatures):
            self.head.read_features(source)

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        started = time.perf_counter()
        n, follow = longest_match(context, gamma)
        ngram_value = self.ngram[n].value(len(follow)) if follow else 0.0
        head_value = self.model.value(gamma)
        explore = self._since_head >= EXPLORE
        if ngram_value >= max(head_value, 1.0) and not explore:
            draft = Draft(tokens=follow)  # point masses
            self._chosen = self.ngram[n]
            self.choices["ngram"] += 1
            self._since_head += 1
        elif head_value >= 1.0 or explore:
            draft = self.head.propose(context, gamma, params, generator)
            self._chosen = self.model
            self.choices["head"] += 1
            self._since_head = 0
        else:  # a plain step is worth more than either draft
            draft = Draft(tokens=[])
            self._chosen = None
            self.choices["none"] += 1
            self._since_head += 1
        self._drafted = len(draft.tokens)
        self._proposed_at = time.perf_counter()
        self._draft_seconds = self._proposed_at - started
        return draft

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Update the chosen option's α and c (the time since proposing is the target's
        verification)."""
        self.head.observe(context, num_accepted)
        chosen = self._chosen
        if chosen is None or self._drafted == 0:
            return
        chosen.update_alpha(self._drafted, num_accepted)
        verify_seconds = time.perf_counter() - self._proposed_at
        if verify_seconds > 0:
            chosen.update_cost(self._draft_seconds / self._drafted / verify_seconds)
