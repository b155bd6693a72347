"""Prompt lookup: draft by copying what followed the latest earlier match of the suffix.

No model and no distribution: drafts are point masses (q one-hot), which the verifier
handles exactly. Helps on inputs that repeat (code editing, retrieval QA, summaries).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculative.drafters.base import Draft
from speculative.drafters.tree import DraftTree
from speculative.sampling import SamplingParams


def find_continuation(
    context: Sequence[int], gamma: int, max_ngram: int, min_ngram: int
) -> list[int]:
    """Tokens following the most recent earlier occurrence of the longest matching suffix."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        suffix = list(context[n_ctx - n :])
        for start in range(n_ctx - n - 1, -1, -1):
            if list(context[start : start + n]) == suffix:
                follow = list(context[start + n : start + n + gamma])
                if follow:
                    return follow
    return []


def find_continuations(
    context: Sequence[int], depth: int, max_ngram: int, min_ngram: int, limit: int
) -> list[list[int]]:
    """Continuations (up to ``depth`` tokens) after the most recent earlier occurrences of
    the context's suffix, longest suffixes first, then most recent first; at most
    ``limit`` distinct ones."""
    n_ctx = len(context)
    found: list[list[int]] = []
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        suffix = list(context[n_ctx - n :])
        for start in range(n_ctx - n - 1, -1, -1):
            if list(context[start : start + n]) == suffix:
                follow = list(context[start + n : start + n + depth])
                if follow and follow not in found:
                    found.append(follow)
                    if len(found) == limit:
                        return found
    return found


def trie(continuations: list[list[int]], budget: int) -> DraftTree:
    """The token trie of ``continuations`` (earlier ones first), at most ``budget`` nodes;
    point-mass siblings (distinct tokens under each parent)."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for follow in continuations:
        parent = -1
        for token in follow:
            node = index.get((parent, token))
            if node is None:
                if len(tokens) == budget:
                    break
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                index[(parent, token)] = node
            parent = node
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))  # [n], [n]


class PromptLookupDrafter:
    """n-gram lookup in the prompt and the generated text (point-mass drafts)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min={min_ngram}, max={max_ngram}"
            )
        self.name = "ngram"
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.window = window

    @property
    def forward_calls(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        recent = list(context[-self.window :])
        return Draft(tokens=find_continuation(recent, gamma, self.max_ngram, self.min_ngram))

    def propose_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        """A trie of the continuations of several earlier matches (point masses)."""
        recent = list(context[-self.window :])
        follows = find_continuations(recent, budget, self.max_ngram, self.min_ngram, limit=4)
        return trie(follows, budget)

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        pass
