"""Constrained decoding: which tokens may follow a sequence's output.

A :class:`TokenConstraint` (a grammar, say: :mod:`speculative.structured`) restricts the
target's distribution at every scored position to the tokens it allows after the output so
far (plus, for a drafted position, the drafted tokens before it): the others get logit
−inf, so the distribution is the target's renormalized over the allowed tokens. The
constrained target is then what speculation is exact with respect to, whatever the drafter
proposes: a drafted token the constraint refuses has probability 0 there and verification
rejects it, so no accepted path ever leaves the constraint, and rows after a refused token
are never read (their logits may stay as they are).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


class ConstraintError(ValueError):
    """A row's constraint cannot go on (its grammar failed, say): the row ends with
    finish reason "error" and this message, the rows beside it decode on."""


@runtime_checkable
class TokenConstraint(Protocol):
    """The tokens allowed after a sequence's output, kept as the output grows (one
    instance per sequence: it holds that sequence's state)."""

    def extend(self, tokens: Sequence[int]) -> None:
        """The output grew by ``tokens`` (each allowed where it was emitted)."""
        ...

    def restrict(
        self,
        logits: torch.Tensor,  # [n, vocab] float32, the rows to restrict (changed in place)
        extras: Sequence[Sequence[int]],  # [n] tokens after the output in row i's history
    ) -> torch.Tensor:  # [n, vocab] the same tensor
        """Row i set to −inf wherever a token may not follow output + extras[i]; a row
        whose extras the constraint refuses may be left as it is."""
        ...


@runtime_checkable
class ForcesTokens(Protocol):
    """A constraint that can say which tokens it leaves as the only way on right after the
    output (a grammar's fixed keys and punctuation): the engine drafts them, point-mass,
    in a round of their own instead of asking the row's drafter (a context lookup may
    continue them); verification keeps them exactly as it keeps any draft (the
    constrained target gives them probability 1, or less where the grammar also allows
    another tokenization of the same text)."""

    def forced(self, limit: int) -> list[int]:
        """At most ``limit`` tokens that the constraint forces after the output."""
        ...


@runtime_checkable
class ChecksTokens(Protocol):
    """A constraint that can say whether one token may follow a history, without a
    mask over the vocabulary: a greedy row then takes the target's own argmax wherever the
    constraint allows it (the argmax over the allowed tokens is that same token)."""

    def allows(self, extra: Sequence[int], token: int) -> bool:
        """Whether ``token`` may follow output + ``extra``."""
        ...
