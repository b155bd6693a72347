"""The speculative decoding loop for one sequence: propose → verify → commit.

Each round the drafter proposes γ tokens (or a token tree); the target scores the last
emitted token and the drafted ones in one pass, giving γ + 1 distributions; verification
keeps a prefix of the draft and adds one recovered or bonus token; the stop criteria cut
the emitted tokens exactly; both caches follow the committed sequence on the next call.
With no drafter (or γ = 0) the same loop is plain autoregressive decoding on the same
runtime.

There is one loop: a single sequence is a batch of one. :class:`SpeculativeEngine` runs
:class:`~speculative.engine.batch.BatchEngine` with one row on the target's own cache
(a :class:`~speculative.models.session.ModelSession`, so drafters that read the target's
features or prompt cache are primed from it); the round itself (propose, verify, commit)
is in :mod:`speculative.engine.round`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from speculative.drafters.base import Drafter
from speculative.engine.batch import BatchEngine, BatchRequest, new_state
from speculative.engine.gamma import FixedGamma, GammaPolicy
from speculative.engine.round import (
    DecodeState,
    GenerationResult,
    Round,
    Verifier,
    commit_tokens,
    propose_draft,
    verify_draft,
)
from speculative.engine.stats import GenerationStats
from speculative.engine.stopping import StopCriteria
from speculative.engine.tree import TreeRound
from speculative.models.base import CausalLM
from speculative.models.session import ModelSession, SinglePool
from speculative.sampling import SamplingParams
from speculative.sampling.constraints import ConstraintError, TokenConstraint
from speculative.sampling.penalties import Penalties

__all__ = [
    "DecodeState",
    "GenerationResult",
    "Round",
    "SpeculativeEngine",
    "Verifier",
    "commit_tokens",
    "propose_draft",
    "verify_draft",
]


class SpeculativeEngine:
    """Drives a target model and an optional drafter through speculative rounds."""

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None = None,
        gamma: GammaPolicy | int = 4,
        tree: TreeRound | None = None,
        prefill_chunk: int | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        """tree: draft token trees with this strategy instead of chains of γ tokens.
        prefill_chunk: most prompt tokens per prefill pass (None: the prompt in one).
        verifier: replaces the exact block verification; only deliberately broken rules go
        here, the negative controls of ``speculative check`` and the tests."""
        self.target = ModelSession(target)
        self.drafter = drafter
        self.gamma_policy = FixedGamma(gamma) if isinstance(gamma, int) else gamma
        self.tree = tree
        self.prefill_chunk = prefill_chunk
        self.verifier = verifier

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop: StopCriteria,
        generator: torch.Generator,
        stats: GenerationStats | None = None,
        logprobs: int | None = None,
        penalties: Penalties | None = None,
        prompt_logprobs: int | None = None,
        constraint: TokenConstraint | None = None,
    ) -> Iterator[Round]:
        """Yield each round's emitted tokens until a stop criterion fires.

        ``stats`` (a fresh one when None) is updated in place as the rounds go, so a caller
        that keeps a reference can read it during and after the stream. ``logprobs``: each
        round also carries its tokens' log-probabilities with this many alternatives
        (:attr:`Round.logprobs`; None: none). ``penalties``: of the target's logits.
        ``prompt_logprobs``: the first round carries the prompt's tokens' log-probabilities
        with this many alternatives (:attr:`Round.prompt_logprobs`). ``constraint``: the
        tokens allowed after the output (a fresh instance per generation).
        """
        batch = BatchEngine(
            self.target.model, max_batch=1, prefill_chunk=self.prefill_chunk,
            pool=SinglePool(self.target), verifier=self.verifier,
        )  # fmt: skip
        request = BatchRequest(
            prompt_ids, params, stop, generator, self.drafter, self.gamma_policy, tree=self.tree,
            logprobs=logprobs, penalties=penalties, prompt_logprobs=prompt_logprobs,
            constraint=constraint,
        )  # fmt: skip
        row = batch.add(request, stats)
        while row in batch.rows:
            round_ = batch.step().get(row)  # None while the prompt is being prefilled
            if round_ is not None and round_.reason == "error":  # its constraint failed
                raise ConstraintError(batch.finished[row].error or "the constraint failed")
            if round_ is not None:
                yield round_

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stop: StopCriteria,
        generator: torch.Generator,
        penalties: Penalties | None = None,
        constraint: TokenConstraint | None = None,
    ) -> GenerationResult:
        """Run to completion; returns the generated ids (prompt excluded) and stats."""
        stats = GenerationStats()
        rounds = list(
            self.stream(
                prompt_ids, params, stop, generator, stats, penalties=penalties,
                constraint=constraint,
            )
        )  # fmt: skip
        tokens = [t for r in rounds for t in r.tokens]
        return GenerationResult(
            token_ids=tokens,
            stats=stats,
            finish_reason=rounds[-1].reason if rounds else None,
            rounds=rounds,
        )

    def start(self, prompt_ids: Sequence[int], stats: GenerationStats | None = None) -> DecodeState:
        """A new generation's state (the prompt checked against the context window);
        the drafter forgets the previous one."""
        state = new_state(prompt_ids, self.target.model.max_length, stats)
        if self.drafter is not None:
            self.drafter.reset()
        return state
