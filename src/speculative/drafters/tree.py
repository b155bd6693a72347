"""Token trees: what a tree drafter proposes, and the protocol it implements.

A :class:`DraftTree` is flat: node i holds ``tokens[i]`` and ``parents[i]`` (-1 = the
root, i.e. the last committed token); parents come before children and siblings are in
the order they were drawn. Under sampling the siblings of a node are drawn WITHOUT
replacement from ``q`` (the processed draft distribution after their parent; every
sibling carries the same row), which is what the verifier
(:func:`speculative.sampling.verify_tree`) assumes. ``q = None`` marks point-mass
siblings (deterministic candidates: greedy top-k, n-gram continuations).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from speculative.sampling import SamplingParams
from speculative.sampling.tree import parents_come_first

TREE_MODES = ("off", "static", "dynamic")


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [n] int64, node tokens in draft order
    parents: torch.Tensor  # [n] int64, parent node index, -1 = the root
    q: torch.Tensor | None = None  # [n, vocab] float32, the distribution node i was drawn from

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).reshape(-1)
        n = self.tokens.shape[0]
        if self.parents.shape[0] != n:
            raise ValueError(f"{n} tokens but {self.parents.shape[0]} parents")
        if not parents_come_first(self.parents.tolist()):
            raise ValueError("parents[i] must lie in [-1, i): parents come before children")
        if self.q is not None and (self.q.dim() != 2 or self.q.shape[0] != n):
            raise ValueError(f"q must be [n={n}, vocab], got {tuple(self.q.shape)}")

    @classmethod
    def chain(cls, tokens: Sequence[int], q: torch.Tensor | None = None) -> DraftTree:
        """A chain of drafted tokens as a tree.   q: [len(tokens), vocab] or None."""
        return cls(torch.tensor(list(tokens)), torch.arange(len(tokens)) - 1, q)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def depths(self) -> torch.Tensor:
        """[n] depth of each node: 1 for children of the root."""
        depth = [0] * self.size
        for node, parent in enumerate(self.parents.tolist()):
            depth[node] = 1 if parent < 0 else depth[parent] + 1
        return torch.tensor(depth, dtype=torch.long)

    def ancestor_mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool: row/column 0 is the root, i + 1 is node i; entry [a, b]
        is True iff b is a or an ancestor of a (the tree attention mask): the session's
        mask for a tree after a one-token chain, its root."""
        from speculative.models.session import tree_attention

        return tree_attention(self.parents.tolist(), 1)[0]

    def path_to(self, node: int) -> list[int]:
        """Node indices from a child of the root down to ``node`` (inclusive)."""
        path: list[int] = []
        parents = self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]


@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter that can propose a tree of candidates (besides its chain ``propose``)."""

    def propose_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        """At most ``budget`` nodes following ``context``; randomness only from ``generator``."""
        ...


@dataclass(frozen=True)
class TreeAsk:
    """One row's request for a tree: what its drafter's ``propose_tree`` would take."""

    drafter: TreeDrafter
    context: Sequence[int]
    budget: int
    params: SamplingParams
    generator: torch.Generator


@runtime_checkable
class DraftsTreesTogether(Protocol):
    """A tree drafter whose draft passes can serve several rows at once (a draft model
    whose cache slots hold the rows' drafts). Drafters with the same ``row_group()``
    (None: this one drafts alone) propose in one :meth:`propose_trees` call, which gives
    each row exactly the tree its own ``propose_tree`` would: the same nodes, q and
    generator draws, the same forward-call count."""

    def row_group(self) -> Hashable | None: ...

    def propose_trees(self, asks: Sequence[TreeAsk]) -> list[DraftTree]:
        """Each ask's tree (budget ≥ 1); every ask's drafter has this one's ``row_group``."""
        ...


@dataclass(frozen=True)
class TreeShape:
    """How a tree drafter shapes its trees.

    mode: "static": every node at depth d gets ``branching[d]`` children (the tree ends
    after ``len(branching)`` levels), filled breadth-first in draw order until the node
    budget is spent; "dynamic": grow the most likely branches (EAGLE-2 style ranking by
    estimated path acceptance, see :class:`AcceptanceCalibration`) up to ``depth``
    levels with ``width`` candidates per expanded node, while a path is at least
    ``min_score`` likely and can still enter the ``budget`` best nodes; drafters decide
    which nodes they expand (the model drafter: only its best path, one step a level).
    """

    mode: str = "static"
    branching: tuple[int, ...] = (2, 2, 1, 1)
    depth: int = 6
    width: int = 2
    min_score: float = 0.1  # dynamic: stop growing when no frontier path is this likely
    sibling_below: float = 0.8  # dynamic, sampling: add siblings where acceptance is less likely

    def __post_init__(self) -> None:
        if self.mode not in ("static", "dynamic"):
            raise ValueError(f"tree mode must be 'static' or 'dynamic', got {self.mode!r}")
        if not self.branching or min(self.branching) < 1:
            raise ValueError(f"branching must be positive counts, got {self.branching}")
        if self.depth < 1 or self.width < 1:
            raise ValueError("depth and width must be >= 1")


@runtime_checkable
class SupportsTreeShape(Protocol):
    """A tree drafter whose tree shape can be chosen (``--tree static|dynamic``)."""

    def set_tree_shape(self, shape: TreeShape) -> None: ...


class AcceptanceCalibration:
    """How often a tree candidate turns out to be the target's token, learned online.

    Keyed by the candidate's rank among its siblings (0 = the draft's argmax) and a bin of
    its draft probability q; the prior is q itself with ``prior_weight`` pseudo-counts, so
    an unused drafter starts out EAGLE-2-like (path probability = product of q) and a
    drafter whose argmax agrees with the target more often than its q says (the target
    at lower precision) learns to grow deeper chains.
    """

    BINS = 5

    def __init__(self, prior_weight: float = 4.0) -> None:
        self.prior_weight = prior_weight
        self.hits: dict[tuple[int, int], float] = {}
        self.tries: dict[tuple[int, int], float] = {}

    def _key(self, rank: int, q: float) -> tuple[int, int]:
        return rank, min(self.BINS - 1, int(q * self.BINS))

    def estimate(self, rank: int, q: float) -> float:
        """P(candidate == target token | its parent was accepted)."""
        key = self._key(rank, q)
        prior = (key[1] + 0.5) / self.BINS
        hits, tries = self.hits.get(key, 0.0), self.tries.get(key, 0.0)
        return (hits + self.prior_weight * prior) / (tries + self.prior_weight)

    def record(self, rank: int, q: float, hit: bool) -> None:
        key = self._key(rank, q)
        self.tries[key] = self.tries.get(key, 0.0) + 1
        self.hits[key] = self.hits.get(key, 0.0) + float(hit)

    def learn(self, tree: RankedTree, emitted: Sequence[int]) -> None:
        """Walk ``tree`` along the tokens the round emitted: at each reached node, every
        child was tried and the child equal to the emitted token (if any) was a hit."""
        node = -1
        for token in emitted:
            match = None
            for child in tree.children(node):
                hit = tree.tokens[child] == token
                self.record(tree.ranks[child], tree.probs[child], hit)
                match = child if hit else match
            if match is None:
                return
            node = match


@dataclass
class RankedTree:
    """A proposed tree's candidates with their sibling rank and draft probability."""

    tokens: list[int]
    parents: list[int]
    ranks: list[int]
    probs: list[float]
    start: int  # context length when proposed: the round's tokens follow it

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]
