"""Tree rounds: draft a token tree, verify every node in one target pass, keep one path.

:class:`TreeRound` is the strategy :class:`~speculative.engine.loop.SpeculativeEngine`
delegates a round to when it drafts trees: propose a tree (at most ``budget`` nodes),
score root + nodes with one tree-masked forward, verify (greedy walk, or recursive
rejection sampling over siblings), keep only the accepted path in the target's cache,
then commit through the engine like a chain round (stop cut, stats, drafter feedback).
Stats count drafted = tree nodes and accepted = path length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from speculative.drafters.tree import DraftTree, TreeDrafter
from speculative.sampling import SamplingParams, logits_to_probs, one_hot_argmax
from speculative.sampling.tree import TreeVerifyResult, verify_tree, verify_tree_greedy

if TYPE_CHECKING:
    from speculative.engine.loop import DecodeState, Round, SpeculativeEngine
    from speculative.engine.stopping import StopCriteria

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
    """One tree round per call; ``verifier`` is replaceable (negative controls in tests)."""

    drafter: TreeDrafter
    budget: int = DEFAULT_TREE_BUDGET
    verifier: TreeVerifier = verify_tree

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"tree budget must be >= 1 node, got {self.budget}")

    def run(
        self,
        engine: SpeculativeEngine,
        state: DecodeState,
        params: SamplingParams,
        generator: torch.Generator,
        stop: StopCriteria,
    ) -> Round:
        tree = self.propose(engine, state, params, generator)
        result = self.verify(engine, state, tree, params, generator)
        engine.target.keep_path(result.path)
        return engine.commit_tokens(state, tree.size, result.tokens, result.num_accepted, stop)

    def propose(
        self,
        engine: SpeculativeEngine,
        state: DecodeState,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        budget = self.budget
        limit = engine.target.model.max_length
        if limit is not None:  # root + nodes must fit the context window
            budget = max(0, min(budget, limit - len(state.sequence) - 1))
        if budget == 0:
            return DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        calls_before = engine.drafter.forward_calls if engine.drafter is not None else 0
        tree = self.drafter.propose_tree(state.sequence, budget, params, generator)
        if engine.drafter is not None:
            state.stats.draft_calls += engine.drafter.forward_calls - calls_before
        if tree.size > budget:
            raise ValueError(f"the drafter proposed {tree.size} nodes for a budget of {budget}")
        return tree

    def verify(
        self,
        engine: SpeculativeEngine,
        state: DecodeState,
        tree: DraftTree,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> TreeVerifyResult:
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        logits = engine.target.logits_for_tree(state.sequence, tokens, parents)[0]  # [n+1, V]
        if params.greedy and self.verifier is verify_tree:
            return verify_tree_greedy(tree.tokens, tree.parents, logits)
        # a replaced verifier (a negative control) sees one-hot argmax rows when greedy
        process = one_hot_argmax if params.greedy else lambda x: logits_to_probs(x, params)
        target_probs = process(logits)  # [n + 1, vocab]
        return self.verifier(tree.tokens, tree.parents, tree.q, target_probs, generator, False)
