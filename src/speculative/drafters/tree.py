# ruff: noqa: E501  (the shared DraftTree definition, kept verbatim)
"""Tree drafts: several candidate continuations sharing prefixes, verified in one pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from speculative.sampling import SamplingParams


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [n] int64, node tokens in draft order (parents before children; siblings in draw order)
    parents: torch.Tensor  # [n] int64, parent node index, -1 = the root (the last committed token)
    q: torch.Tensor | None  # [n, vocab] float32: the processed draft distribution node i was drawn from (its parent's); None = point mass (greedy/ngram)


@runtime_checkable
class TreeDrafter(Protocol):
    def propose_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree: ...
