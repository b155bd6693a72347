"""Medusa drafting: K residual heads on the target's feature of the last position it has
processed; head k proposes the token k positions after the one that feature's own logits
give (the recovered or bonus token just committed)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import cast

import torch

from speculative.capabilities import provides
from speculative.drafters.base import Draft, RowAsk
from speculative.drafters.head_common import (
    HeadDrafter,
    draft_distribution,
    draw,
    draw_without_replacement,
    true_feature_count,
)
from speculative.drafters.tree import DraftTree
from speculative.heads.runners import MedusaRunner, TorchMedusaRunner
from speculative.heads.store import TrainedHead
from speculative.models.base import SupportsWeightBytes
from speculative.sampling import SamplingParams

TREE_TOP_K = (3, 2, 2, 1)  # children per node by depth (cartesian product of heads' top-k)


class MedusaDrafter(HeadDrafter):
    """Chain and tree proposals from Medusa heads.

    runner: what computes the heads' draft logits (default: the PyTorch module; the
    registry passes :class:`~speculative.heads.runners.KernelMedusaRunner` when the
    target runs on the C kernels)."""

    method = "medusa"

    def __init__(
        self,
        head: TrainedHead,
        vocab_size: int,
        name: str = "medusa",
        runner: MedusaRunner | None = None,
    ) -> None:
        super().__init__(head, vocab_size, name)
        self.runner = runner if runner is not None else TorchMedusaRunner(head)
        self.heads = head.config.medusa_heads

    def _feature(self, context: Sequence[int]) -> torch.Tensor | None:
        """The target's feature [H] of context[-2] (whose own logits gave the last token:
        the normal state after a verification), or None when it is not at hand. Of a
        target whose features carry middle layers too, their first H: the last layer's."""
        n = len(context)
        if n < 2 or true_feature_count(self.target, context) < n - 1:
            return None
        return self.target.features[n - 2, : self.head.config.hidden_size]  # type: ignore[union-attr]

    def _head_logits(self, context: Sequence[int], count: int) -> torch.Tensor | None:
        """Draft logits [count, N] of heads 1..count, or None without the feature."""
        feature = self._feature(context)
        if feature is None:
            return None
        self._calls += 1
        return self.runner(feature, min(count, self.heads))

    def draft_weight_bytes(self) -> int:
        """:class:`ReportsDraftCost`: the packed heads' weight bytes (0 on PyTorch)."""
        runner = self.runner
        return runner.weight_bytes() if provides(runner, SupportsWeightBytes) else 0

    def draft_backlog(self, context: Sequence[int]) -> int:
        """:class:`ReportsDraftCost`: none (the heads read one feature, no cache)."""
        return 0

    def row_group(self) -> Hashable | None:
        """Rows sharing kernel-packed heads draft in one call."""
        return self.runner.together

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
        """Chains of several rows (each ask's drafter a MedusaDrafter of this row group):
        every row's heads in one call where the runners share kernels."""
        drafters = [cast(MedusaDrafter, ask.drafter) for ask in asks]
        features = [d._feature(ask.context) for d, ask in zip(drafters, asks, strict=True)]
        live = [i for i, f in enumerate(features) if f is not None]
        counts = [min(asks[i].gamma, drafters[i].heads) for i in live]
        together = self.runner.together
        if len(live) > 1 and together is not None:
            rows = together.many(torch.stack([features[i] for i in live]), counts)
        else:
            rows = [drafters[i].runner(features[i], c) for i, c in zip(live, counts, strict=True)]
        logits: list[torch.Tensor | None] = [None] * len(asks)
        for i, row in zip(live, rows, strict=True):
            drafters[i]._calls += 1
            logits[i] = row
        return [
            Draft(tokens=[]) if row is None else d._draft(row, ask.params, ask.generator)
            for d, ask, row in zip(drafters, asks, logits, strict=True)
        ]

    def _draft(
        self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> Draft:
        """A chain from the heads' draft logits [count, N]."""
        if params.greedy:  # the first argmax of each head's logits (numpy: no one-hot)
            indices = logits.numpy().argmax(axis=-1).tolist()
            return Draft(tokens=[self.target_token(i) for i in indices])
        probs = draft_distribution(logits, params)  # [gamma, N]
        tokens = [self.target_token(draw(row, params, generator)) for row in probs]
        q = self.full_vocab(probs)
        return Draft(tokens=tokens, probs=q.unsqueeze(0))  # [1, len, vocab]

    @torch.no_grad()
    def propose_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        """Cartesian top-k: each node at depth d gets TREE_TOP_K[d] children from head d + 1
        (top-k under greedy; drawn without replacement per node under sampling)."""
        logits = self._head_logits(context, len(TREE_TOP_K))
        tokens: list[int] = []
        parents: list[int] = []
        rows: list[torch.Tensor] = []
        if logits is None:
            empty = torch.empty(0, dtype=torch.long)
            return DraftTree(tokens=empty, parents=empty.clone(), q=None)
        # greedy: rank by the heads' own probabilities (the processed q is one-hot)
        probs = torch.softmax(logits, -1) if params.greedy else draft_distribution(logits, params)
        frontier = [-1]
        for depth in range(probs.shape[0]):
            children = []
            for parent in frontier:
                room = budget - len(tokens)
                count = min(TREE_TOP_K[depth], room)
                for index in draw_without_replacement(probs[depth], count, params, generator):
                    tokens.append(self.target_token(index))
                    parents.append(parent)
                    rows.append(probs[depth])
                    children.append(len(tokens) - 1)
            frontier = children
            if not frontier or len(tokens) >= budget:
                break
        q = None
        if not params.greedy and rows:
            q = self.full_vocab(torch.stack(rows))
        return DraftTree(
            tokens=torch.tensor(tokens, dtype=torch.long),
            parents=torch.tensor(parents, dtype=torch.long),
            q=q,
        )
