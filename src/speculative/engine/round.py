"""One row's round: propose → verify → commit.

The drafter proposes γ tokens (or a token tree); the target scores the row's last emitted
token and the drafted ones in one pass (shared with the other rows of a batch), giving
γ + 1 distributions; verification keeps a prefix of the draft and adds one recovered or
bonus token; the stop criteria cut the emitted tokens exactly. With no drafter (or γ = 0)
the same round is plain autoregressive decoding on the same runtime.

These functions are the only round code: :class:`~speculative.engine.batch.BatchEngine`
runs them for every row of a pass, and the single-sequence
:class:`~speculative.engine.loop.SpeculativeEngine` is a batch of one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from speculative.drafters.base import Draft, Drafter, DraftsRowsTogether, RowAsk
from speculative.drafters.tree import DraftTree
from speculative.engine.stats import GenerationStats
from speculative.engine.stopping import StopCriteria
from speculative.models.base import RowInput
from speculative.sampling import (
    SamplingParams,
    VerifyResult,
    VerifyUniforms,
    logits_to_probs,
    one_hot_argmax,
    verify_greedy,
    verify_greedy_row,
    verify_logits,
)
from speculative.sampling.probs import NucleusSearch
from speculative.sampling.tree import TreeVerifyResult

Verifier = Callable[..., VerifyResult]  # the signature of sampling.verify


@dataclass(frozen=True)
class TokenLogprobs:
    """An emitted token's log-probability under the target's raw distribution (its
    logits' log-softmax: before temperature, top-k and top-p, as vLLM reports them by
    default) and the ``top`` likeliest tokens there with theirs, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict[str, object]:
        """JSON: ``token``, ``logprob`` and ``top`` as ``[[token, logprob], ...]``."""
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}


@dataclass(frozen=True)
class Round:
    """What one round emitted: ``tokens``, of which the first ``num_accepted`` were drafted
    tokens the target accepted; the rest (at most one) was recovered or bonus.
    ``logprobs``: one per token, where the row asked for them."""

    tokens: list[int]
    num_accepted: int
    drafted: int
    finished: bool
    reason: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str | None = None
    rounds: list[Round] = field(default_factory=list)
    error: str | None = None  # why the row failed (finish_reason "error"), else None

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        """One per token of ``token_ids`` where the generation asked for them, else None."""
        return rounds_logprobs(self.rounds)

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """One per prompt token after the first (its log-probability after the tokens
        before it) where the generation asked for them, else None."""
        first = self.rounds[0].prompt_logprobs if self.rounds else None
        return None if first is None else list(first)


def rounds_logprobs(rounds: Sequence[Round]) -> list[TokenLogprobs] | None:
    """The rounds' tokens' log-probabilities in order, or None where they were not asked
    for (or no round ran)."""
    if not rounds or any(r.logprobs is None for r in rounds):
        return None
    return [entry for r in rounds for entry in r.logprobs or ()]


def emitted_logprobs(
    logits: torch.Tensor,  # [n, vocab] the target's logits at each emitted token's position
    tokens: Sequence[int],  # [n] the emitted tokens
    top: int,
) -> tuple[TokenLogprobs, ...]:
    """Each token's log-probability under its row and the ``top`` likeliest tokens'."""
    n = len(tokens)
    if n == 0:
        return ()
    logprobs = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, vocab]
    chosen = logprobs[torch.arange(n), torch.tensor(list(tokens))].tolist()
    alternatives: list[tuple[tuple[int, float], ...]] = [()] * n
    if top > 0:
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [n, top]
        alternatives = [
            tuple(zip(row_ids, row_values, strict=True))
            for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
        ]
    return tuple(
        TokenLogprobs(token, logprob, alts)
        for token, logprob, alts in zip(tokens, chosen, alternatives, strict=True)
    )


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


@dataclass
class Proposal:
    """A row's proposal for one round (a chain ``draft`` or a ``tree``) and the row of
    the shared target pass that verifies it."""

    request: RowInput
    draft: Draft | None = None
    tree: DraftTree | None = None
    uniforms: VerifyUniforms | None = None  # a sampled chain's, drawn with the draft

    @property
    def drafted(self) -> int:
        if self.tree is not None:
            return self.tree.size
        return len(self.draft.tokens) if self.draft is not None else 0


def draft_length(gamma: int, state: DecodeState, max_length: int | None) -> int:
    """``gamma``, cut where the verification pass would overflow the context window."""
    if max_length is None:
        return gamma
    return max(0, min(gamma, max_length - len(state.sequence) - 1))


def propose_drafts_together(
    lead: DraftsRowsTogether, asks: list[RowAsk], states: list[DecodeState]
) -> list[Draft]:
    """The chain drafts of rows whose drafters share ``lead``'s row group, in one
    ``propose_rows`` call (each γ already cut by :func:`draft_length`, ≥ 1); counts each
    row's forward calls in its stats, as :func:`propose_draft` does."""
    before = [ask.drafter.forward_calls for ask in asks]
    drafts = lead.propose_rows(asks)
    for ask, state, calls in zip(asks, states, before, strict=True):
        state.stats.draft_calls += ask.drafter.forward_calls - calls
    return drafts


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
    gamma = draft_length(gamma, state, max_length)
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
    best: list[int] | None = None,  # [γ+1] the logits' argmax, when the model took it
    search: NucleusSearch | None = None,
    uniforms: VerifyUniforms | None = None,
) -> VerifyResult:
    """Greedy check (temperature 0) or modified rejection sampling of one row's draft
    (``verify_logits``: verify's result from the logits, processing only the rows read).
    ``verifier`` replaces the exact rule: only the deliberately broken rules of negative
    controls go there; it is given one-hot argmax target rows when greedy. ``best``: the
    greedy check's argmax rows, taken by the target's forward (``SupportsFusedArgmax``);
    ``search``: the target's top-p nucleus search (``SupportsNucleusSearch``);
    ``uniforms``: verify_logits's own, drawn ahead from ``generator``."""
    if verifier is not None:
        drafted = torch.tensor([draft.tokens], dtype=torch.long).reshape(1, -1)  # [1, γ]
        probs = one_hot_argmax(logits) if params.greedy else logits_to_probs(logits, params)
        return verifier(drafted, draft.dense_probs(), probs, generator, validate=False)
    if params.greedy:
        if best is not None and len(best) == len(draft.tokens) + 1:
            return verify_greedy_row(draft.tokens, best)
        drafted = torch.tensor([draft.tokens], dtype=torch.long).reshape(1, -1)  # [1, γ]
        return verify_greedy(drafted, logits)
    return verify_logits(draft.tokens, draft.q, logits, params, generator, search, uniforms)


def accepted(result: VerifyResult | TreeVerifyResult) -> tuple[list[int], int]:
    """(emitted tokens, number of them that were accepted drafts) of a verified round."""
    if isinstance(result, TreeVerifyResult):
        return result.tokens, result.num_accepted
    return result.emitted(0), result.accepted_count(0)


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
