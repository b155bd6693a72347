"""Tree rounds: draft a token tree, verify every node in one target pass, keep one path.

:class:`TreeRound` is a row's round strategy when it drafts trees (per row, in
:class:`~speculative.engine.batch.BatchEngine` and so in the single-sequence engine):
propose a tree (at most ``budget`` nodes), score root + nodes inside the shared target
pass with the row's own tree mask, verify (greedy walk, or recursive rejection sampling
over siblings), keep only the accepted path in the row's cache, then commit like a chain
round (stop cut, stats, drafter feedback). Stats count drafted = tree nodes and
accepted = path length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from speculative.drafters.base import Drafter
from speculative.drafters.tree import (
    TREE_MODES,
    DraftsTreesTogether,
    DraftTree,
    SupportsTreeShape,
    TreeAsk,
    TreeDrafter,
    TreeShape,
)
from speculative.engine.stats import GenerationStats
from speculative.sampling import SamplingParams, logits_to_probs, one_hot_argmax
from speculative.sampling.tree import TreeVerifyResult, verify_tree, verify_tree_greedy

TreeVerifier = Callable[..., TreeVerifyResult]  # the signature of verify_tree
DEFAULT_TREE_BUDGET = 6  # nodes per tree: the fp32 kernels verify ~5-7 tokens near flat
FLAT_VERIFY = 1.3  # budget_from_verify_cost: how much dearer than one step a tree may be


def budget_from_verify_cost(verify_cost: dict[int, float], flat: float = FLAT_VERIFY) -> int:
    """Tree nodes to draft from a measured verify-cost curve T(k)/T(1) (k = 1 + nodes):
    the largest k whose cost stays within ``flat`` (and all smaller k too), minus 1."""
    k = 1
    while k + 1 in verify_cost and verify_cost[k + 1] <= flat:
        k += 1
    return max(1, k - 1)


@dataclass
class TreeRound:
    """A row's tree strategy; ``verifier`` is replaceable (negative controls in tests)."""

    drafter: TreeDrafter
    budget: int = DEFAULT_TREE_BUDGET
    verifier: TreeVerifier = verify_tree

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"tree budget must be >= 1 node, got {self.budget}")

    def propose(
        self,
        sequence: Sequence[int],
        max_length: int | None,
        params: SamplingParams,
        generator: torch.Generator,
        stats: GenerationStats,
        counted: Drafter | None = None,
    ) -> DraftTree:
        """A tree of at most ``budget`` nodes after ``sequence`` (fewer near the context
        limit); ``counted``: the drafter whose forward calls go to ``stats``."""
        ask = self.ask(sequence, max_length, params, generator)
        if ask.budget == 0:
            return _no_tree()
        calls_before = counted.forward_calls if counted is not None else 0
        tree = self.drafter.propose_tree(sequence, ask.budget, params, generator)
        if counted is not None:
            stats.draft_calls += counted.forward_calls - calls_before
        return _checked(tree, ask.budget)

    def ask(
        self,
        sequence: Sequence[int],
        max_length: int | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> TreeAsk:
        """What this round asks its drafter for: a tree of at most ``budget`` nodes after
        ``sequence`` (fewer near the context limit: root + nodes must fit)."""
        budget = self.budget
        if max_length is not None:
            budget = max(0, min(budget, max_length - len(sequence) - 1))
        return TreeAsk(self.drafter, sequence, budget, params, generator)

    def verify(
        self,
        tree: DraftTree,
        logits: torch.Tensor,  # [n + 1, vocab]: after the root, after each node
        params: SamplingParams,
        generator: torch.Generator,
    ) -> TreeVerifyResult:
        if params.greedy and self.verifier is verify_tree:
            return verify_tree_greedy(tree.tokens, tree.parents, logits)
        # a replaced verifier (a negative control) sees one-hot argmax rows when greedy
        process = one_hot_argmax if params.greedy else lambda x: logits_to_probs(x, params)
        target_probs = process(logits)  # [n + 1, vocab]
        return self.verifier(tree.tokens, tree.parents, tree.q, target_probs, generator, False)


def propose_trees_together(
    lead: DraftsTreesTogether, asks: Sequence[TreeAsk], stats: Sequence[GenerationStats]
) -> list[DraftTree]:
    """The trees of rows whose drafters share ``lead``'s row group (:meth:`TreeRound.ask`'s
    asks), in one ``propose_trees`` call for those with room for a node; counts each row's
    forward calls in its stats, as :meth:`TreeRound.propose` does."""
    live = [i for i, ask in enumerate(asks) if ask.budget > 0]
    counted = [cast(Drafter, ask.drafter) for ask in asks]
    before = [d.forward_calls for d in counted]
    grown = dict(zip(live, lead.propose_trees([asks[i] for i in live]), strict=True))
    for drafter, row_stats, calls in zip(counted, stats, before, strict=True):
        row_stats.draft_calls += drafter.forward_calls - calls
    return [_checked(grown[i], ask.budget) if i in grown else _no_tree()
            for i, ask in enumerate(asks)]  # fmt: skip


def _no_tree() -> DraftTree:
    return DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))


def _checked(tree: DraftTree, budget: int) -> DraftTree:
    if tree.size > budget:
        raise ValueError(f"the drafter proposed {tree.size} nodes for a budget of {budget}")
    return tree


def make_tree_round(
    mode: str, drafter: Drafter | None, budget: int = DEFAULT_TREE_BUDGET
) -> TreeRound | None:
    """The tree strategy for ``--tree off|static|dynamic`` (None: chains of γ tokens)."""
    if mode not in TREE_MODES:
        raise ValueError(f"tree must be one of {', '.join(TREE_MODES)}, got {mode!r}")
    if mode == "off" or drafter is None:
        return None
    if not isinstance(drafter, TreeDrafter):
        raise ValueError(f"the '{drafter.name}' drafter cannot draft trees; use tree 'off'")
    if isinstance(drafter, SupportsTreeShape):
        drafter.set_tree_shape(TreeShape(mode))
    return TreeRound(drafter, budget)
