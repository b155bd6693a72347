"""The speculative decoding loop: propose → verify → accept → commit.

Each round the drafter proposes γ tokens; the target scores the last emitted token and
the γ drafted ones in one pass, giving γ + 1 distributions; verification keeps a prefix of
the draft and adds one recovered or bonus token; the stop criteria cut the emitted tokens
exactly; both caches follow the committed sequence on the next call. With no drafter (or
γ = 0) the same loop is plain autoregressive decoding on the same runtime.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from speculative.drafters.base import Draft, Drafter, SupportsPriming
from speculative.engine.gamma import FixedGamma, GammaPolicy, SupportsCostFeedback
from speculative.engine.stats import GenerationStats
from speculative.engine.stopping import StopCriteria
from speculative.engine.tree import TreeRound
from speculative.models.base import CausalLM
from speculative.models.session import ModelSession
from speculative.sampling import (
    SamplingParams,
    VerifyResult,
    logits_to_probs,
    one_hot_argmax,
    verify,
    verify_greedy,
)

Verifier = Callable[..., VerifyResult]  # the signature of sampling.verify


@dataclass(frozen=True)
class Round:
    """What one round emitted: ``tokens``, of which the first ``num_accepted`` were drafted
    tokens the target accepted; the rest (at most one) was recovered or bonus."""

    tokens: list[int]
    num_accepted: int
    drafted: int
    finished: bool
    reason: str | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str | None = None
    rounds: list[Round] = field(default_factory=list)


@dataclass
class DecodeState:
    """Per-generation state: the committed sequence and its bookkeeping."""

    sequence: list[int]
    prompt_length: int
    stats: GenerationStats
    finished: bool = False
    reason: str | None = None

    @property
    def generated(self) -> list[int]:
        return self.sequence[self.prompt_length :]


class SpeculativeEngine:
    """Drives a target model and an optional drafter through speculative rounds."""

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None = None,
        gamma: GammaPolicy | int = 4,
        tree: TreeRound | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        """tree: draft token trees with this strategy instead of chains of γ tokens.
        verifier: replaces the exact block verification (None: :func:`verify`, or
        :func:`verify_greedy` at temperature 0); only deliberately broken rules go here,
        the negative controls of ``speculative check``."""
        self.target = ModelSession(target)
        self.drafter = drafter
        self.gamma_policy = FixedGamma(gamma) if isinstance(gamma, int) else gamma
        self.tree = tree
        self.verifier = verifier

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop: StopCriteria,
        generator: torch.Generator,
        stats: GenerationStats | None = None,
    ) -> Iterator[Round]:
        """Yield each round's emitted tokens until a stop criterion fires.

        ``stats`` (a fresh one when None) is updated in place as the rounds go, so a caller
        that keeps a reference can read it during and after the stream.
        """
        state = self.start(prompt_ids, stats)
        started = time.perf_counter()
        self.target.sync(state.sequence[:-1])  # prefill
        if isinstance(self.drafter, SupportsPriming):
            self.drafter.prime(self.target)
        state.stats.prefill_seconds = time.perf_counter() - started
        while not state.finished:
            if self.tree is not None:
                round_ = self.tree.run(self, state, params, generator, stop)
            else:
                round_started = time.perf_counter()
                draft = self.propose(state, params, generator)
                proposed = time.perf_counter()
                result = self.verify(state, draft, params, generator)
                if isinstance(self.gamma_policy, SupportsCostFeedback) and draft.tokens:
                    verified = time.perf_counter()
                    self.gamma_policy.observe_costs(
                        len(draft.tokens), proposed - round_started, verified - proposed
                    )
                round_ = self.commit(state, draft, result, stop)
            state.stats.seconds = time.perf_counter() - started
            yield round_

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop: StopCriteria,
        generator: torch.Generator,
    ) -> GenerationResult:
        """Run to completion; returns the generated ids (prompt excluded) and stats."""
        stats = GenerationStats()
        rounds = list(self.stream(prompt_ids, params, stop, generator, stats))
        tokens = [t for r in rounds for t in r.tokens]
        return GenerationResult(
            token_ids=tokens,
            stats=stats,
            finish_reason=rounds[-1].reason if rounds else None,
            rounds=rounds,
        )

    def start(
        self, prompt_ids: Sequence[int], stats: GenerationStats | None = None
    ) -> DecodeState:
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        limit = self.target.model.max_length
        if limit is not None and len(prompt_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context window is {limit}"
            )
        if self.drafter is not None:
            self.drafter.reset()
        return DecodeState(
            sequence=list(prompt_ids),
            prompt_length=len(prompt_ids),
            stats=GenerationStats() if stats is None else stats,
        )

    def propose(
        self, state: DecodeState, params: SamplingParams, generator: torch.Generator
    ) -> Draft:
        gamma = self.gamma_policy.next_gamma() if self.drafter is not None else 0
        limit = self.target.model.max_length
        return propose_draft(self.drafter, gamma, state, limit, params, generator)

    def verify(
        self,
        state: DecodeState,
        draft: Draft,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> VerifyResult:
        logits = self.target.logits_after(state.sequence, draft.tokens)  # [1, γ+1, vocab]
        return verify_draft(draft, logits, params, generator, self.verifier)

    def commit(
        self, state: DecodeState, draft: Draft, result: VerifyResult, stop: StopCriteria
    ) -> Round:
        num_accepted = int(result.num_accepted[0])
        if self.drafter is not None:
            self.gamma_policy.update(len(draft.tokens), num_accepted)
        return self.commit_tokens(state, len(draft.tokens), result.emitted(0), num_accepted, stop)

    def commit_tokens(
        self,
        state: DecodeState,
        drafted: int,
        emitted: list[int],
        num_accepted: int,
        stop: StopCriteria,
    ) -> Round:
        """Append a round's emitted tokens (cut by ``stop``) and record it."""
        limit = self.target.model.max_length
        return commit_tokens(state, self.drafter, limit, drafted, emitted, num_accepted, stop)


# ---- the steps of a round, shared by the single-sequence and the batched engine ---------


def propose_draft(
    drafter: Drafter | None,
    gamma: int,
    state: DecodeState,
    max_length: int | None,
    params: SamplingParams,
    generator: torch.Generator,
) -> Draft:
    """Ask ``drafter`` for up to ``gamma`` tokens after ``state.sequence`` (fewer where the
    verification pass would overflow the context window); counts its forward calls."""
    if max_length is not None:  # the verification pass must fit the context window
        gamma = max(0, min(gamma, max_length - len(state.sequence) - 1))
    if gamma == 0 or drafter is None:
        return Draft(tokens=[])
    calls_before = drafter.forward_calls
    draft = drafter.propose(state.sequence, gamma, params, generator)
    state.stats.draft_calls += drafter.forward_calls - calls_before
    return draft


def verify_draft(
    draft: Draft,
    logits: torch.Tensor,  # [1, γ+1, vocab] target logits after the context and each draft
    params: SamplingParams,
    generator: torch.Generator,
    verifier: Verifier | None = None,
) -> VerifyResult:
    """Greedy check (temperature 0) or modified rejection sampling of one row's draft;
    ``verifier`` (a negative control) is given one-hot argmax target rows when greedy."""
    drafted = torch.tensor([draft.tokens], dtype=torch.long).reshape(1, -1)  # [1, γ]
    if verifier is not None:
        probs = one_hot_argmax(logits) if params.greedy else logits_to_probs(logits, params)
        return verifier(drafted, draft.probs, probs, generator, validate=False)
    if params.greedy:
        return verify_greedy(drafted, logits)
    target_probs = logits_to_probs(logits, params)  # [1, γ+1, vocab]
    return verify(drafted, draft.probs, target_probs, generator, validate=False)


def commit_tokens(
    state: DecodeState,
    drafter: Drafter | None,
    max_length: int | None,
    drafted: int,
    emitted: list[int],
    num_accepted: int,
    stop: StopCriteria,
) -> Round:
    """Append a round's emitted tokens (cut by ``stop``), record it, tell the drafter."""
    cut = stop.cut(state.generated, emitted)
    kept = emitted[: cut.keep]
    state.sequence.extend(kept)
    state.stats.record_round(drafted, num_accepted, len(kept))
    if drafter is not None:
        drafter.observe(state.sequence, num_accepted)
    state.finished, state.reason = cut.finished, cut.reason
    if not state.finished and max_length is not None and len(state.sequence) >= max_length:
        state.finished, state.reason = True, "context"
    return Round(
        tokens=kept,
        num_accepted=min(num_accepted, len(kept)),
        drafted=drafted,
        finished=state.finished,
        reason=state.reason,
    )
