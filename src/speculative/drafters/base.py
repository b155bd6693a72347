"""The drafter protocol: propose up to γ tokens, then hear what was accepted."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from speculative.sampling import SamplingParams
from speculative.sampling.probs import RowProbs

if TYPE_CHECKING:
    from speculative.models.base import CausalLM
    from speculative.models.session import FeatureSource, RowSession


@dataclass(frozen=True)
class Draft:
    """A proposal for the next tokens.

    tokens: the drafted token ids (at most γ; may be empty when the drafter has nothing).
    probs:  [1, len(tokens), vocab] processed draft distributions q the tokens were drawn
            from, or None for a point-mass drafter (q is one-hot at each drafted token).
    rows:   the same q as sparse rows over the target's ``vocab`` tokens, instead of
            ``probs`` (a head's top-p rows: tens of entries where a dense row has 49k);
            :meth:`dense_probs` gives them as ``probs`` would.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None  # [1, len(tokens), vocab]
    rows: tuple[RowProbs, ...] | None = None  # len(tokens) rows over vocab token ids
    vocab: int = 0  # the vocabulary of ``rows``

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[1] != len(self.tokens):
            raise ValueError(
                f"draft probs cover {self.probs.shape[1]} positions for {len(self.tokens)} tokens"
            )
        if self.rows is not None:
            if self.probs is not None:
                raise ValueError("a draft gives q either dense (probs) or sparse (rows)")
            if len(self.rows) != len(self.tokens) or self.vocab < 1:
                raise ValueError(
                    f"{len(self.rows)} sparse q rows over vocab {self.vocab} for "
                    f"{len(self.tokens)} tokens"
                )

    @property
    def q(self) -> torch.Tensor | tuple[RowProbs, ...] | None:
        """q as the verifier reads it: the sparse rows where given, else ``probs``."""
        return self.rows if self.rows is not None else self.probs

    def dense_probs(self) -> torch.Tensor | None:
        """[1, len(tokens), vocab] q (``probs``, or the sparse rows made dense), or None
        for a point mass."""
        if self.rows is None:
            return self.probs
        if not self.rows:
            return torch.zeros(1, 0, self.vocab)
        return torch.stack([row.dense(self.vocab) for row in self.rows]).unsqueeze(0)


class Drafter(Protocol):
    """Proposes tokens for the target to verify. One class per drafting strategy."""

    name: str

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        """Draft up to ``gamma`` tokens following ``context`` (prompt + emitted tokens).

        Drafts must be sampled from the returned ``probs`` processed with ``params`` (the
        same processing as the target), drawing randomness only from ``generator``.
        """
        ...

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Feedback after verification: ``context`` now ends with the emitted tokens."""
        ...

    @property
    def forward_calls(self) -> int:
        """Number of model forward passes spent drafting so far (0 for model-free drafters)."""
        ...

    def reset(self) -> None:
        """Forget any per-sequence state before a new generation."""
        ...


@runtime_checkable
class RunsDraftModel(Protocol):
    """A drafter that runs a causal LM of its own (a smaller model, the target at a cheaper
    precision, the target's first layers): cost measurements time that model's steps."""

    @property
    def draft_model(self) -> CausalLM: ...


@runtime_checkable
class LooksUpContext(Protocol):
    """A drafter that copies what followed the longest earlier match of the context's end
    (prompt lookup), comparing at most :meth:`longest_ngram` tokens: transformers'
    prompt-lookup decoding is its peer."""

    def longest_ngram(self) -> int: ...


def draft_model_of(drafter: object) -> CausalLM | None:
    """The causal LM a drafter runs, or None for a model-free drafter (or none)."""
    return drafter.draft_model if isinstance(drafter, RunsDraftModel) else None


@runtime_checkable
class ReadsTargetFeatures(Protocol):
    """A drafter that drafts from the target's features (EAGLE, Medusa heads): it reads
    them from the row's session, whether the row is the model's single sequence or one
    cache slot of a batch."""

    def read_features(self, source: FeatureSource) -> None:
        """Read the target's features from ``source`` from now on (once per generation,
        right after the target prefilled the prompt)."""
        ...


@runtime_checkable
class ShedsTargetFeatures(Protocol):
    """A :class:`ReadsTargetFeatures` drafter that can go on drafting without them (``auto``:
    from n-gram lookup alone). Copying the features out costs every pass a few per cent; a
    batch whose load keeps the row from drafting for many rounds has it shed them."""

    def shed_features(self) -> None:
        """Draft without the target's features from now on, until :meth:`reset`."""
        ...


@runtime_checkable
class SupportsPriming(Protocol):
    """A drafter that can start from the target's prompt prefill (see ModelSession.adopt),
    whether its row is the model's single sequence or one cache slot of a batch."""

    def prime(self, target: RowSession) -> None:
        """Called once per generation, right after the target prefilled the prompt."""
        ...


@runtime_checkable
class SupportsDraftSituation(Protocol):
    """A drafter that can say, before drafting, which kind of round this is: a class of
    context whose acceptance differs from the others' (n-gram lookup: how long the match
    it would copy from is). A γ policy that learns per situation
    (:class:`~speculative.engine.gamma.SupportsSituations`) then drafts long where
    drafts are usually kept and short where they are usually not. It changes only how
    much is drafted, never what is emitted."""

    def draft_situation(self, context: Sequence[int]) -> Hashable:
        """The situation of a round that drafts after ``context`` (small, hashable)."""
        ...


@runtime_checkable
class ReportsDraftCost(Protocol):
    """A drafter that can say what drafting will cost before it is timed: the weights a
    draft step streams (a load policy's prior for c) and the positions its next draft
    must first feed (its cache lags the sequence after rounds that drafted nothing, and a
    catch-up over many positions costs a pass of that many tokens)."""

    def draft_weight_bytes(self) -> int:
        """Weight bytes one draft step reads (its model's or head's); 0 when unknown."""
        ...

    def draft_backlog(self, context: Sequence[int]) -> int:
        """Positions of ``context`` the next draft feeds before its first draft token's
        step, besides the one every round feeds (0: none, or nothing to feed)."""
        ...


@runtime_checkable
class ChoosesDraftLength(Protocol):
    """A drafter that picks its own draft length each round from measured costs (γ is
    then only its cap). With ``--gamma auto`` it gets the target's measured verify-cost
    curve instead of an adaptive γ policy, which would second-guess its choice."""

    def use_verify_cost(self, verify_cost: dict[int, float]) -> None:
        """The measured T(k)/T(1), k = 1..max, as the prior of the drafter's own timings."""
        ...


@dataclass(frozen=True)
class RowAsk:
    """One row's request for a chain draft: what its drafter's ``propose`` would take."""

    drafter: Drafter
    context: Sequence[int]
    gamma: int
    params: SamplingParams
    generator: torch.Generator


@runtime_checkable
class DraftsRowsTogether(Protocol):
    """A drafter whose draft steps can serve several rows at once (one weight stream per
    step for every row: a drafting head on the C kernels). Drafters with the same
    ``row_group()`` (None: this one drafts alone) propose in one :meth:`propose_rows` call,
    which gives each row exactly the draft its own ``propose`` would: the same tokens, q
    and generator draws, the same forward-call count."""

    def row_group(self) -> Hashable | None:
        """What rows must share to draft together (None: this drafter drafts alone)."""
        ...

    def propose_rows(self, asks: Sequence[RowAsk]) -> list[Draft]:
        """Each ask's chain draft; every ask's drafter has this one's ``row_group``."""
        ...
