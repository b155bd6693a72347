"""EAGLE-style drafting: a one-layer head over [token embedding, target feature].

The head reads the target's features of the committed positions (from the target's
session: the verify forward computed them) and its own predicted features for drafted
ones. It keeps a small KV cache over the pairs it processed; the entries made from true
features survive across rounds (rolled back by common prefix), drafted ones are redone.
A head far behind (a long prompt) catches up on the last CATCH_UP_WINDOW pairs only.

Pair t is (feature f_t, token x_{t+1}) at position t; processing it predicts f_{t+1},
whose logits over the draft vocabulary give the distribution of x_{t+2}.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from speculative.capabilities import provides
from speculative.drafters.base import Draft, RowAsk
from speculative.drafters.head_common import (
    HeadDrafter,
    draft_distribution,
    draw_from_logits,
    draw_without_replacement,
    embedding_rows,
    true_feature_count,
)
from speculative.drafters.tree import DraftTree
from speculative.heads.runners import EagleRunner, TorchEagleRunner
from speculative.heads.store import TrainedHead
from speculative.models.base import SupportsWeightBytes
from speculative.models.session import common_prefix_length
from speculative.sampling import SamplingParams
from speculative.sampling.probs import NucleusSearch, RowProbs

STATIC_BRANCHING = (3, 2, 2, 1, 1, 1, 1, 1)  # children per expanded node, by depth
STATIC_WIDTH = (1, 2, 2, 3, 3, 3, 3, 3)  # expanded nodes per depth (first in draw order)
DYNAMIC_TOP_K = 4  # EAGLE-2: children considered per expanded node
DYNAMIC_WIDTH = 4  # EAGLE-2: nodes expanded per depth (best path probabilities)
DYNAMIC_DEPTH = 3  # depths expanded (EAGLE-2 uses 6; see docs/trees.md)
CATCH_UP_WINDOW = 128  # the most true pairs a catch-up runs (a long prompt: its last ones)


@dataclass
class HeadCache:
    """A runner and the tokens x_{t+1} of the true pairs t = 0, 1, ... of the context it
    follows. Its cache holds pairs ``first`` .. len(pairs) - 1: a catch-up that skipped
    the pairs before ``first`` (see :meth:`EagleDrafter._catch_up`). Cache slot i holds
    pair first + i, at RoPE position i (attention sees only differences of positions)."""

    runner: EagleRunner
    pairs: list[int] = field(default_factory=list)
    first: int = 0

    def restart(self, first: int, context: Sequence[int]) -> None:
        """An empty cache that will hold pairs from ``first`` on of ``context``."""
        self.runner.length = 0
        self.first = first
        self.pairs = list(context[1 : first + 1])


class EagleDrafter(HeadDrafter):
    """Chain and tree proposals from an EAGLE head (see module docstring).

    runner: what runs the head's steps (default: the head's PyTorch module; the registry
    passes :class:`~speculative.heads.runners.KernelEagleRunner` when the target runs on
    the C kernels). Trees run on a sibling of it (the same weights, a cache of its own),
    whose steps take masks over the cached tree nodes."""

    method = "eagle"

    def __init__(
        self,
        head: TrainedHead,
        vocab_size: int,
        name: str = "eagle",
        runner: EagleRunner | None = None,
        search: NucleusSearch | None = None,
        window: int | None = CATCH_UP_WINDOW,
    ) -> None:
        super().__init__(head, vocab_size, name, search)
        if window is not None and window < 1:
            raise ValueError(f"the catch-up window must be at least one pair, got {window}")
        self.chain = HeadCache(runner if runner is not None else TorchEagleRunner(head))
        self._tree: HeadCache | None = None
        self.window = window  # None: every true pair, however many

    @property
    def tree_cache(self) -> HeadCache:
        """The trees' runner and cache (made on first use)."""
        if self._tree is None:
            self._tree = HeadCache(self.chain.runner.sibling())
        return self._tree

    def draft_weight_bytes(self) -> int:
        """:class:`ReportsDraftCost`: the packed head's weight bytes (0 on PyTorch)."""
        runner = self.chain.runner
        return runner.weight_bytes() if provides(runner, SupportsWeightBytes) else 0

    def draft_backlog(self, context: Sequence[int]) -> int:
        """:class:`ReportsDraftCost`: the true pairs of ``context`` the chain's head cache
        lacks, beyond the one a round adds (rows that drafted nothing lag further)."""
        true = min(true_feature_count(self.target, context), len(context) - 1)
        lacking = true - common_prefix_length(self.chain.pairs, context[1 : true + 1])
        return max(0, min(lacking, self.window or lacking) - 1)

    def reset(self) -> None:
        for cache in (self.chain, self._tree):
            if cache is not None:
                cache.restart(0, [])

    # ---- the head over the committed context ----------------------------------------
    def _catch_up(self, cache: HeadCache, context: Sequence[int]) -> _Feed | None:
        """Roll the head's cache back to the true pairs it shares with ``context`` and
        return the feed of the true pairs it lacks (at least the last one, whose
        prediction drafting starts from), or None when the target gave no features.

        Where it lacks more than ``window`` pairs (a long prompt, a row that has not
        drafted for long), the cache starts over from the last ``window`` of them: the
        head then attends over fewer pairs, which changes its drafts, never the output
        (verification keeps it exact), and bounds what a catch-up costs."""
        true = min(true_feature_count(self.target, context), len(context) - 1)
        if true < 1:
            return None
        keep = common_prefix_length(cache.pairs, context[1 : true + 1])
        if keep == true:  # nothing new: redo the last true pair to get its prediction
            keep -= 1
        if keep < cache.first:  # the context changed in the pairs the cache skipped
            cache.restart(0, context)
            keep = 0
        if self.window is not None and true - keep > self.window:
            keep = true - self.window
            cache.restart(keep, context)
        cache.runner.length = keep - cache.first
        del cache.pairs[keep:]
        cache.pairs.extend(context[keep + 1 : true + 1])
        features = self.target.features  # type: ignore[union-attr]
        return _Feed(self, cache, context[keep + 1 : true + 1], features[keep:true], keep)

    def _sync(
        self, cache: HeadCache, context: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Bring the head's cache to the committed ``context``; returns the predicted
        feature of position len(context) - 1 ([H]) and its draft logits ([N]: the next
        token's), or None when the target gave no features."""
        feed = self._catch_up(cache, context)
        if feed is None:
            return None
        return self._finish_sync(feed, self._feed_all([feed])[0], context)

    def _finish_sync(
        self, feed: _Feed, predicted: tuple[torch.Tensor, torch.Tensor], context: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After ``feed``: the pairs whose features the target has not given yet (none
        after a normal round), on the head's own predictions."""
        for t in range(feed.start + len(feed.tokens), len(context) - 1):
            step = _Feed(self, feed.cache, [context[t + 1]], predicted[0].unsqueeze(0), t)
            predicted = self._feed_all([step])[0]
        return predicted

    def _feed_all(self, feeds: Sequence[_Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each feed's pairs (features[i], tokens[i]) at positions start + i -> its last
        prediction ([H] feature, [N] logits); the feeds of rows whose runners step
        together in one call, else one call each. The feeds' drafters count their calls."""
        embeds = [embedding_rows(f.owner.head.embedding, f.tokens) for f in feeds]
        positions = [f.owner.positions(f.start - f.cache.first, len(f.tokens)) for f in feeds]
        runners = [f.cache.runner for f in feeds]
        together = runners[0].together
        if len(feeds) > 1 and together is not None and all(r.together is together for r in runners):
            features = [f.features for f in feeds]
            outputs = together.step_rows(runners, embeds, features, positions)
        else:
            outputs = [
                r.step(e, f.features, p)
                for r, e, f, p in zip(runners, embeds, feeds, positions, strict=True)
            ]
        for feed in feeds:
            feed.owner._calls += 1
        return [(out[-1], logits[-1]) for out, logits in outputs]

    # ---- chain -------------------------------------------------------------------------
    def row_group(self) -> Hashable | None:
        """Rows whose heads share packed kernels draft in shared steps."""
        return self.chain.runner.together

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        return self.propose_rows([RowAsk(self, context, gamma, params, generator)])[0]

    @torch.no_grad()
    def propose_rows(self, asks: Sequence[RowAsk]) -> list[Draft]:
        """Chains of several rows (each ask's drafter an EagleDrafter of this row group):
        one catch-up step, then one step per draft position, for all rows together."""
        chains: list[_Chain | None] = []
        feeds = []
        for ask in asks:
            drafter = cast(EagleDrafter, ask.drafter)
            feed = drafter._catch_up(drafter.chain, ask.context)
            chains.append(None if feed is None else _Chain(ask, drafter))
            if feed is not None:
                feeds.append(feed)
        live = [c for c in chains if c is not None]
        for chain, feed, out in zip(live, feeds, self._feed_all(feeds) if feeds else [],
                                    strict=True):  # fmt: skip
            chain.feature, chain.logits = chain.drafter._finish_sync(feed, out, chain.ask.context)
        for i in range(max((c.ask.gamma for c in live), default=0)):
            drawn = [(c, c.draw(i)) for c in live if i < c.ask.gamma]
            steps = [(c, feed) for c, feed in drawn if feed is not None]
            if steps:
                outs = self._feed_all([feed for _, feed in steps])
                for (chain, _), (feature, logits) in zip(steps, outs, strict=True):
                    chain.feature, chain.logits = feature, logits
        return [Draft(tokens=[]) if c is None else c.draft() for c in chains]

    # ---- tree --------------------------------------------------------------------------
    @torch.no_grad()
    def propose_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        """A tree of at most ``budget`` nodes: EAGLE-2's dynamic expansion by path
        probability under greedy; a static shape (children drawn without replacement,
        counts fixed by depth and draw rank) under sampling."""
        root = self._sync(self.tree_cache, context)
        if root is None or budget < 1:
            return _empty_tree(params)
        if params.greedy:
            return self._dynamic_tree(root, budget)
        return self._static_tree(root, budget, params, generator)

    def _expand(self, base: int, nodes: list[int], tree: _Growing, outputs: dict) -> None:
        """Run the head over ``nodes`` (one depth, each seeing its ancestors), storing
        their predicted features and logits in ``outputs`` (node + 1 -> (feature, logits))."""
        runner = self.tree_cache.runner
        start = runner.length
        slots = {node: start + i for i, node in enumerate(nodes)}
        # [nodes, start + nodes] bool, in numpy: element writes cost a tenth of torch's
        mask = np.zeros((len(nodes), start + len(nodes)), dtype=bool)
        mask[:, :base] = True  # the true pairs
        for i, node in enumerate(nodes):
            for ancestor in tree.path(node):
                mask[i, tree.slot[ancestor] if ancestor in tree.slot else slots[ancestor]] = True
        tokens = [tree.tokens[node] for node in nodes]
        parent_features = torch.stack([outputs[tree.parents[node] + 1][0] for node in nodes])
        positions = torch.tensor([base - 1 + tree.depth[node] for node in nodes])
        ids = torch.tensor(tokens, dtype=torch.long)
        out, logits = runner.step(
            self.head.embedding[ids], parent_features, positions, torch.from_numpy(mask)
        )
        self._calls += 1
        tree.slot.update(slots)
        for i, node in enumerate(nodes):
            outputs[node + 1] = (out[i], logits[i])

    def _dynamic_tree(self, root: tuple[torch.Tensor, torch.Tensor], budget: int) -> DraftTree:
        runner = self.tree_cache.runner
        base = runner.length
        tree = _Growing()
        outputs = {0: root}  # node + 1 -> (predicted feature [H], draft logits [N])
        frontier = [-1]
        depths = min(budget, DYNAMIC_DEPTH)
        for depth in range(depths):
            candidates = []
            for parent in frontier:
                logp = torch.log_softmax(outputs[parent + 1][1], -1)
                top = torch.topk(logp, DYNAMIC_TOP_K)
                base_score = tree.score[parent] if parent >= 0 else 0.0
                for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    token = self.target_token(index)
                    candidates.append(tree.add(token, parent, base_score + value))
            if depth + 1 == depths:  # the deepest candidates are leaves: nothing reads
                break  # what an expansion would predict after them
            frontier = sorted(candidates, key=lambda n: -tree.score[n])[:DYNAMIC_WIDTH]
            self._expand(base, frontier, tree, outputs)
        runner.length = base
        return tree.best(budget)

    def _static_tree(
        self,
        root: tuple[torch.Tensor, torch.Tensor],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        runner = self.tree_cache.runner
        base = runner.length
        tree = _Growing()
        outputs = {0: root}
        rows: list[torch.Tensor] = []
        frontier = [-1]
        for depth in range(len(STATIC_BRANCHING)):
            children = []
            parents = frontier[: STATIC_WIDTH[depth]]
            # every parent's row in one call (rows are processed independently)
            depth_probs = draft_distribution(
                torch.stack([outputs[parent + 1][1] for parent in parents]), params
            )  # [parents, N]
            for parent, probs in zip(parents, depth_probs, strict=True):
                room = budget - len(tree.tokens)
                drawn = draw_without_replacement(
                    probs, min(STATIC_BRANCHING[depth], room), params, generator
                )
                for index in drawn.tolist():
                    children.append(tree.add(self.target_token(index), parent, 0.0))
                    rows.append(probs)
            if not children or len(tree.tokens) >= budget:
                break
            frontier = children[: STATIC_WIDTH[depth + 1]] if depth + 1 < len(STATIC_WIDTH) else []
            if frontier:
                self._expand(base, frontier, tree, outputs)
        runner.length = base
        return tree.as_draft(self.full_vocab(torch.stack(rows)))


@dataclass
class _Feed:
    """Pairs to append to a head cache: (features[i], tokens[i]) as pairs start + i (at
    positions start + i - cache.first), for ``owner`` (the drafter whose call it counts)."""

    owner: EagleDrafter
    cache: HeadCache
    tokens: Sequence[int]
    features: torch.Tensor  # [k, H]
    start: int


@dataclass
class _Chain:
    """One row's chain while it is drafted: the prediction drafting continues from, and
    the tokens (and their processed rows, under sampling) drawn so far."""

    ask: RowAsk
    drafter: EagleDrafter
    feature: torch.Tensor | None = None  # [H]
    logits: torch.Tensor | None = None  # [N]
    tokens: list[int] = field(default_factory=list)
    rows: list[RowProbs] = field(default_factory=list)  # over the N draft indices

    def draw(self, i: int) -> _Feed | None:
        """Draft i from the current logits; the feed that predicts the next one (None
        after the last)."""
        ask, drafter = self.ask, self.drafter
        assert self.logits is not None and self.feature is not None
        index, probs = draw_from_logits(self.logits, ask.params, ask.generator, drafter.search)
        token = drafter.target_token(index)
        self.tokens.append(token)
        if probs is not None:
            self.rows.append(probs)
        if i + 1 >= ask.gamma:
            return None
        position = len(ask.context) - 1 + i
        return _Feed(drafter, drafter.chain, [token], self.feature.unsqueeze(0), position)

    def draft(self) -> Draft:
        if self.ask.params.greedy or not self.tokens:
            return Draft(tokens=self.tokens)
        rows = tuple(self.drafter.target_row(row) for row in self.rows)  # q, sparse
        return Draft(tokens=self.tokens, rows=rows, vocab=self.drafter.vocab_size)


class _Growing:
    """A tree under construction: node i has tokens[i], parents[i], depth[i], score[i]."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depth: list[int] = []
        self.score: list[float] = []
        self.slot: dict[int, int] = {}  # node -> head cache slot once expanded

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.score.append(score)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The node and its ancestors."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out

    def best(self, budget: int) -> DraftTree:
        """The ``budget`` nodes of highest path log-probability, closed under ancestors,
        parents before children (a point-mass tree: greedy)."""
        order = sorted(range(len(self.tokens)), key=lambda n: (-self.score[n], self.depth[n]))
        chosen: set[int] = set()
        for node in order:
            path = [n for n in self.path(node) if n not in chosen]
            if len(chosen) + len(path) > budget:
                continue
            chosen.update(path)
            if len(chosen) >= budget:
                break
        kept = sorted(chosen, key=lambda n: (self.depth[n], n))
        return self._subset(kept, None)

    def as_draft(self, q: torch.Tensor) -> DraftTree:
        return self._subset(list(range(len(self.tokens))), q)

    def _subset(self, kept: list[int], q: torch.Tensor | None) -> DraftTree:
        index = {node: i for i, node in enumerate(kept)}
        parents = [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in kept]
        return DraftTree(
            tokens=torch.tensor([self.tokens[n] for n in kept], dtype=torch.long),
            parents=torch.tensor(parents, dtype=torch.long),
            q=None if q is None else q[kept],
        )


def _empty_tree(params: SamplingParams) -> DraftTree:
    empty = torch.empty(0, dtype=torch.long)
    return DraftTree(tokens=empty, parents=empty.clone(), q=None)
