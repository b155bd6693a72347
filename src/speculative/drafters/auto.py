"""``auto``: per round, draft from n-gram lookup or from a head, whichever promises more
tokens per second, at the draft length that promises most; or draft nothing.

For each option the drafter keeps running estimates of its per-token acceptance α (the
n-gram option separately per match-length class: 1, 2, 3, 4–7 and 8 or more tokens of
the longest earlier match, :func:`~speculative.drafters.ngram.best_match`) and of its
drafting time per token. It also keeps the measured time of a verification of k tokens,
for each k it has seen (the target's pass and the rest of the round: what a round of
k − 1 drafts costs beyond drafting). A round of g drafts is expected to emit
(1 − α^(g+1)) / (1 − α) tokens in g·d + V(g + 1) seconds; a plain step emits one token in
V(1). Each option takes the g (up to the round's γ) with the most tokens per second; the
best of the options and the plain step wins. So a draft runs only where it pays on this
machine: where verifying more tokens costs more (int4 on AVX2: T(5)/T(1) ≈ 1.3–1.7) a
weak guess drafts fewer tokens or none. V(k) is kept as a scale that every round updates
times a shape per k (:class:`~speculative.round_costs.VerifyTimes`, the estimator the
adaptive γ policy keeps too). After EXPLORE rounds without it, the head
drafts one token in the next round that would otherwise be a plain step, so that its
estimate stays current; it never displaces an n-gram draft that pays. A batch whose load
keeps the row from drafting for many rounds has it shed the head
(:meth:`AutoDrafter.shed_features`): n-gram lookup alone, and no target features copied
out for it, until the next sequence.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from speculative.capabilities import provides
from speculative.drafters.base import (
    Draft,
    Drafter,
    DraftsRowsTogether,
    ReadsTargetFeatures,
    ReportsDraftCost,
    RowAsk,
    SupportsPriming,
)
from speculative.drafters.ngram import (
    SITUATION_CLASSES,
    ContextIndex,
    continuation,
    match_situation,
)
from speculative.models.session import FeatureSource, RowSession
from speculative.round_costs import VerifyTimes
from speculative.sampling import SamplingParams
from speculative.theory import decayed_average, expected_tokens

DECAY = 0.9  # weight of the past in the running estimates
MAX_NGRAM = 16  # the longest match compared
EXPLORE = 8  # rounds without the head after which a plain round drafts one (keeps α current)
WINDOW = 2048


@dataclass
class Estimate:
    """One option's running per-token acceptance α and drafting cost: ``prior_cost``
    (in verifications of one token) until ``seconds`` per drafted token is measured."""

    alpha: float
    prior_cost: float
    seconds: float | None = None

    def per_token(self, unit: float) -> float:
        """Drafting seconds per token (``unit``: the estimated V(1))."""
        return self.prior_cost * unit if self.seconds is None else self.seconds

    def update_alpha(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        failures = 0 if accepted >= drafted else 1
        observed = accepted / (accepted + failures)
        self.alpha = decayed_average(self.alpha, observed, DECAY)

    def update_seconds(self, seconds: float) -> None:
        self.seconds = decayed_average(self.seconds, seconds, DECAY)


@dataclass(frozen=True)
class Choice:
    """An option at a draft length and its expected tokens per second."""

    option: str  # "ngram", "head" or "none"
    drafts: int
    rate: float


def best_length(estimate: Estimate, cap: int, verify: VerifyTimes) -> Choice:
    """The draft length in 1..cap with the most expected tokens per second."""
    per_token = estimate.per_token(verify.at(1))
    best = Choice("", 0, 0.0)
    for g in range(1, cap + 1):
        emitted = expected_tokens(min(max(estimate.alpha, 0.0), 0.999), g)
        rate = emitted / (g * per_token + verify.at(g + 1))
        if rate > best.rate:
            best = Choice("", g, rate)
    return best


def longest_match(index: ContextIndex, context: Sequence[int], gamma: int) -> tuple[int, list[int]]:
    """(the match's length class, the ``gamma`` tokens of its continuation) for the
    longest earlier match of the context's end within WINDOW tokens (class 0 and no
    tokens: none), found with ``index`` (kept for the sequence across rounds)."""
    match = index.best_match(context, MAX_NGRAM, 1, WINDOW)
    if match is None or gamma < 1:
        return 0, []
    return match_situation(match), continuation(index.tokens, match.end, gamma)


@dataclass
class _Pending:
    """The round between :meth:`AutoDrafter.propose` and :meth:`AutoDrafter.observe`."""

    chosen: Estimate | None
    drafted: int
    draft_seconds: float
    proposed_at: float


@dataclass
class _Round:
    """One row's round while :meth:`AutoDrafter.propose_rows` runs: its choice, then its
    draft."""

    drafter: AutoDrafter
    ask: RowAsk
    choice: Choice = field(default_factory=lambda: Choice("none", 0, 0.0))
    chosen: Estimate | None = None
    draft: Draft = field(default_factory=lambda: Draft(tokens=[]))

    def choose(self) -> None:
        """The option and length (an n-gram draft is taken here: point masses)."""
        drafter, ask = self.drafter, self.ask
        situation, follow = longest_match(drafter.index, ask.context, ask.gamma)
        self.choice = drafter.choose(situation, len(follow), ask.gamma)
        if self.choice.option == "ngram":
            self.draft = Draft(tokens=follow[: self.choice.drafts])
            self.chosen = drafter.ngram[situation]
        elif self.choice.option == "head":
            self.chosen = drafter.model
        # else a plain step promises more tokens per second than either draft

    def head_ask(self) -> RowAsk:
        ask = self.ask
        return RowAsk(self.drafter.head, ask.context, self.choice.drafts, ask.params,
                      ask.generator)  # fmt: skip


class AutoDrafter:
    """Chooses per round between n-gram lookup and ``head`` (any model-based drafter)."""

    def __init__(self, head: Drafter, name: str = "auto") -> None:
        self.name = name
        self.head = head
        self.ngram = {n: Estimate(alpha=0.5, prior_cost=0.01) for n in SITUATION_CLASSES}
        self.model = Estimate(alpha=0.7, prior_cost=0.15)
        self.verify = VerifyTimes()
        self._pending: _Pending | None = None
        self.choices = {"ngram": 0, "head": 0, "none": 0}
        self._since_head = 0
        self.index = ContextIndex()  # the sequence drafted for, for the n-gram lookup
        self.head_shed = False  # shed_features: n-gram lookup alone until reset

    @property
    def forward_calls(self) -> int:
        return self.head.forward_calls

    def reset(self) -> None:
        self.head.reset()
        self._pending = None
        self._since_head = 0
        self.index = ContextIndex()
        self.head_shed = False

    def shed_features(self) -> None:
        """:class:`ShedsTargetFeatures`: the head, which reads the target's features, is
        off for this sequence: n-gram lookup or plain steps only (until :meth:`reset`)."""
        self.head_shed = True

    def prime(self, target: RowSession) -> None:
        if isinstance(self.head, SupportsPriming):
            self.head.prime(target)

    def read_features(self, source: FeatureSource) -> None:
        if isinstance(self.head, ReadsTargetFeatures):
            self.head.read_features(source)

    def draft_weight_bytes(self) -> int:
        """:class:`ReportsDraftCost`: the head's (the dear option; a lookup reads none)."""
        head = self.head
        return head.draft_weight_bytes() if provides(head, ReportsDraftCost) else 0

    def draft_backlog(self, context: Sequence[int]) -> int:
        """:class:`ReportsDraftCost`: the head's, which any round may draft from (it
        explores every EXPLORE rounds); none once it is shed."""
        head = self.head
        if self.head_shed or not provides(head, ReportsDraftCost):
            return 0
        return head.draft_backlog(context)

    def use_verify_cost(self, verify_cost: dict[int, float]) -> None:
        """Take the target's measured T(k)/T(1) as the prior shape of V(k)."""
        self.verify.prior = {int(k): float(v) for k, v in verify_cost.items()}

    def choose(self, situation: int, follow: int, gamma: int) -> Choice:
        """The option and draft length for a round of at most ``gamma`` drafts, with an
        n-gram match of class ``situation`` followed by ``follow`` tokens."""
        best = Choice("none", 0, 1.0 / self.verify.at(1))
        if follow:
            ngram = best_length(self.ngram[situation], follow, self.verify)
            if ngram.rate > best.rate:
                best = Choice("ngram", ngram.drafts, ngram.rate)
        if self.head_shed:
            return best
        head = best_length(self.model, gamma, self.verify)
        if head.rate > best.rate:
            best = Choice("head", head.drafts, head.rate)
        if self._since_head >= EXPLORE and best.option == "none":
            return Choice("head", 1, 0.0)  # explore where it displaces a plain step only
        return best

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        return self.propose_rows([RowAsk(self, context, gamma, params, generator)])[0]

    def row_group(self) -> Hashable | None:
        """Rows whose heads draft together choose together (each its own option)."""
        head = self.head
        group = head.row_group() if provides(head, DraftsRowsTogether) else None
        return None if group is None else ("auto", group)

    def propose_rows(self, asks: Sequence[RowAsk]) -> list[Draft]:
        """Each row's own choice (its estimates, its n-gram match); the rows that choose
        the head draft in one shared call where their heads can (a share of its time each:
        what drafting costs them in this batch)."""
        started = time.perf_counter()
        rounds = [_Round(cast(AutoDrafter, ask.drafter), ask) for ask in asks]
        for r in rounds:
            r.choose()
        heads = [r for r in rounds if r.choice.option == "head"]
        head_started = time.perf_counter()
        if len(heads) > 1 and provides(self.head, DraftsRowsTogether):
            asks_of_heads = [r.head_ask() for r in heads]
            for r, draft in zip(heads, self.head.propose_rows(asks_of_heads), strict=True):
                r.draft = draft
        else:
            for r in heads:
                ask = r.head_ask()
                r.draft = ask.drafter.propose(ask.context, ask.gamma, ask.params, ask.generator)
        head_share = (time.perf_counter() - head_started) / max(1, len(heads))
        chosen_share = (head_started - started) / len(rounds)
        now = time.perf_counter()
        for r in rounds:
            seconds = chosen_share + (head_share if r.choice.option == "head" else 0.0)
            r.drafter.commit_choice(r, seconds, now)
        return [r.draft for r in rounds]

    def commit_choice(self, r: _Round, seconds: float, now: float) -> None:
        """Record the round's choice (counts, the head's exploration clock, the pending
        measurement :meth:`observe` completes)."""
        self.choices[r.choice.option] += 1
        self._since_head = 0 if r.choice.option == "head" else self._since_head + 1
        self._pending = _Pending(r.chosen, len(r.draft.tokens), seconds, now)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Update the chosen option's α and drafting time, and V(drafted + 1) (the time
        since proposing: the verification and the rest of the round)."""
        self.head.observe(context, num_accepted)
        pending, self._pending = self._pending, None
        if pending is None:  # no proposal this round (γ 0): nothing was measured
            return
        verify_seconds = time.perf_counter() - pending.proposed_at
        if verify_seconds > 0:
            self.verify.record(pending.drafted + 1, verify_seconds)
        if pending.chosen is None or pending.drafted == 0:
            return
        pending.chosen.update_alpha(pending.drafted, num_accepted)
        pending.chosen.update_seconds(pending.draft_seconds / pending.drafted)
