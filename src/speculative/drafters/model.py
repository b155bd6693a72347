"""Draft with a separate, cheaper causal LM over the target's vocabulary.

The same class serves every model-based drafter: a smaller model of the same family, the
target itself in lower precision (``self-bf16``), or the target truncated to its first
layers (early exit). Only the :class:`~speculative.models.base.CausalLM` differs.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from speculative.capabilities import provides
from speculative.drafters.base import Draft, RowAsk
from speculative.drafters.tree import (
    AcceptanceCalibration,
    DraftTree,
    RankedTree,
    TreeAsk,
    TreeShape,
)
from speculative.models.base import CausalLM, RowInput, SupportsBatchRows, SupportsWeightBytes
from speculative.models.session import (
    ModelSession,
    RowSession,
    SlotSession,
    common_prefix_length,
)
from speculative.sampling import SamplingParams, logits_to_probs
from speculative.sampling.probs import sample_row
from speculative.sampling.tree import sample_without_replacement


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """logits: [..., draft_vocab] -> [..., vocab], dropping or -inf-padding extra rows."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def _draw(q: torch.Tensor, generator: torch.Generator) -> int:
    """``sample(q[None], generator)``'s token for q [vocab], bit for bit (the same float64
    uniform; :func:`sample_row` sums the positive weights in numpy instead of a cumsum over
    the row in torch)."""
    uniform = float(torch.rand(1, generator=generator, dtype=torch.float64)[0])
    return sample_row(q, uniform)


def draft_session(owner: object, model: CausalLM) -> ModelSession | SlotSession:
    """A draft model's session for ``owner`` (a drafter): a cache slot of its own where the
    model has slots (freed with the owner), so one model serves many rows' drafters; else
    the model's single cache."""
    if provides(model, SupportsBatchRows):
        session = SlotSession(model)
        weakref.finalize(owner, session.release)
        return session
    return ModelSession(model)


def model_weight_bytes(model: CausalLM) -> int:
    """A draft model's weight bytes (:class:`ReportsDraftCost`), 0 when unknown."""
    return model.weight_bytes() if provides(model, SupportsWeightBytes) else 0


class DraftModelDrafter:
    """Autoregressive drafting with a draft model whose cache follows the sequence.

    On a model with cache slots (:class:`SupportsBatchRows`) the drafter holds one slot
    (freed with the drafter), so one draft model serves the drafters of many rows: a
    batch's rows then draft in one pass per draft position (:meth:`propose_rows`), each
    row's draft exactly its own alone. Elsewhere it owns the model's single cache."""

    def __init__(
        self,
        model: CausalLM,
        vocab_size: int,
        name: str = "draft-model",
        follow_target: bool = False,
    ) -> None:
        """follow_target: the target's cache holds keys and values that mean what the
        draft model's do, so before each draft the drafter copies the committed positions
        it lacks from its row's target cache (the prompt, then each round's tokens)
        instead of feeding them through its own passes. For an early exit of the target
        (its first layers, the same weights) they are bitwise the draft model's own; for
        the target at another precision they are the same quantities rounded otherwise
        (lossless either way: only the drafts can change). A row that skipped drafting
        for many rounds (γ = 0) then drafts again without a catch-up pass over everything
        it missed."""
        self.name = name
        self.vocab_size = vocab_size
        self.session = draft_session(self, model)
        self.follow_target = follow_target
        self._target: RowSession | None = None  # followed (follow_target), from prime()
        self.tree_shape = TreeShape()
        self.calibration = AcceptanceCalibration()
        self._last_tree: RankedTree | None = None

    def set_tree_shape(self, shape: TreeShape) -> None:
        self.tree_shape = shape

    @property
    def draft_model(self) -> CausalLM:
        return self.session.model

    @property
    def forward_calls(self) -> int:
        return self.session.forward_calls

    def reset(self) -> None:
        self.session.reset()
        self._last_tree = None
        self._target = None

    def propose(
        self,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        return self.propose_rows([RowAsk(self, context, gamma, params, generator)])[0]

    def draft_weight_bytes(self) -> int:
        """:class:`ReportsDraftCost`: the draft model's weight bytes (0 when unknown)."""
        return model_weight_bytes(self.session.model)

    def draft_backlog(self, context: Sequence[int]) -> int:
        """:class:`ReportsDraftCost`: the positions before ``context[-1]`` that the draft
        model's cache lacks (none while it follows the target: they are copied)."""
        if self._followed() is not None:
            return 0
        return len(context) - 1 - common_prefix_length(self.session.cached, context[:-1])

    def row_group(self) -> Hashable | None:
        """Rows whose drafters hold slots of one draft model draft in shared passes."""
        return self.session.model if isinstance(self.session, SlotSession) else None

    @torch.no_grad()
    def propose_rows(self, asks: Sequence[RowAsk]) -> list[Draft]:
        """Chains of several rows (each ask's drafter a DraftModelDrafter of this row
        group): one draft pass per position for every row still drafting."""
        chains = [_Chain(ask, _model_drafter(ask)) for ask in asks]
        for chain in chains:
            if chain.ask.gamma > 0:
                chain.drafter._catch_up(chain.ask.context)
        for i in range(max((ask.gamma for ask in asks), default=0)):
            live = [c for c in chains if i < c.ask.gamma]
            sessions = [c.drafter.session for c in live]
            logits = _draft_pass_for(sessions, [_Pass(c.sequence) for c in live])
            for chain, row in zip(live, logits, strict=True):
                chain.step(row.unsqueeze(0))
        return [c.draft() for c in chains]

    def prime(self, target: RowSession) -> None:
        """Called once the target has prefilled the prompt (its single sequence or the
        row's cache slot)."""
        if not self.follow_target:
            return
        self._target = target
        if not isinstance(self.session, SlotSession):  # a cache of its own: the prompt once
            self.session.adopt(target)

    def _catch_up(self, context: Sequence[int]) -> None:
        """Following the target: copy the positions of ``context`` that the target's
        cache holds and this drafter's lacks (no pass; see ``follow_target``)."""
        target = self._followed()
        if target is not None:
            cast(SlotSession, self.session).follow(target, context)

    def _followed(self) -> RowSession | None:
        """The target session this drafter's slot follows (``follow_target``), if any."""
        return self._target if isinstance(self.session, SlotSession) else None

    def observe(self, context: Sequence[int], num_accepted: int) -> None:
        """Learn from a dynamic tree's outcome (the cache needs nothing: the next
        propose() rolls it back and catches up)."""
        if self._last_tree is not None:
            self.calibration.learn(self._last_tree, context[self._last_tree.start :])
            self._last_tree = None

    # ---- trees ------------------------------------------------------------------------
    def propose_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        """A tree of at most ``budget`` nodes, one draft forward per level (the tree so far
        scored with a tree mask). Static: ``branching[d]`` children per node, drawn
        without replacement from q under sampling (top-k point masses under greedy).
        Dynamic: the most probable branches (point masses), see :class:`TreeShape`."""
        ask = TreeAsk(self, context, budget, params, generator)
        self._catch_up(context)
        return _grown_alone(self.session, self._grow(ask))

    @torch.no_grad()
    def propose_trees(self, asks: Sequence[TreeAsk]) -> list[DraftTree]:
        """Trees of several rows (each ask's drafter a DraftModelDrafter of this row
        group): every row's next draft pass (a level of its tree, or its path's next
        step) in one pass over their slots, until every tree is grown."""
        drafters = [_model_drafter(ask) for ask in asks]
        for drafter, ask in zip(drafters, asks, strict=True):
            drafter._catch_up(ask.context)
        growing = [d._grow(ask) for d, ask in zip(drafters, asks, strict=True)]
        trees: dict[int, DraftTree] = {}
        wanted = {i: _first(g, trees, i) for i, g in enumerate(growing)}
        wanted = {i: w for i, w in wanted.items() if w is not None}
        while wanted:
            rows = list(wanted)
            sessions = [drafters[i].session for i in rows]
            logits = _draft_pass_for(sessions, [wanted[i] for i in rows])
            for i, out in zip(rows, logits, strict=True):
                next_pass = _send(growing[i], out, trees, i)
                if next_pass is None:
                    del wanted[i]
                else:
                    wanted[i] = next_pass
        return [trees[i] for i in range(len(asks))]

    def _grow(self, ask: TreeAsk) -> _Growth:
        if self.tree_shape.mode == "dynamic":
            return self._dynamic_tree(ask.context, ask.budget, ask.params, ask.generator)
        return self._static_tree(ask.context, ask.budget, ask.params, ask.generator)

    def _level_logits(
        self, context: Sequence[int], tree: _Growing, fed: list[int]
    ) -> Generator[_Pass, torch.Tensor, dict[int, torch.Tensor]]:
        """Draft logits ([vocab]) after the root (key -1) or after each node of ``fed``
        (an ancestor-closed list of node ids of ``tree``), from the pass it yields."""
        if not fed:
            return {-1: (yield _Pass(list(context)))}
        position = {node: i for i, node in enumerate(fed)}
        tokens = [tree.tokens[node] for node in fed]
        parents = [position.get(tree.parents[node], -1) for node in fed]
        logits = yield _Pass(list(context), tokens, parents)  # [1 + len(fed), V]
        return {node: logits[i + 1] for i, node in enumerate(fed)}

    def _static_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> _Growth:
        tree = _Growing()
        frontier = [-1]
        for width in self.tree_shape.branching:
            if tree.size >= budget or not frontier:
                break
            rows = yield from self._level_logits(context, tree, [n for n in range(tree.size)])
            level = torch.stack([fit_vocab(rows[parent], self.vocab_size) for parent in frontier])
            level_q = logits_to_probs(level, params)  # [frontier, vocab]: rows apart, one call
            next_frontier = []
            for parent, logits, q in zip(frontier, level, level_q, strict=True):
                room = min(width, budget - tree.size)
                if params.greedy:
                    kids = torch.topk(logits, room).indices.tolist()
                else:
                    kids = sample_without_replacement(q, room, generator)
                next_frontier += [tree.add(x, parent, None if params.greedy else q) for x in kids]
            frontier = next_frontier
        return tree.freeze(point_mass=params.greedy)

    def _dynamic_tree(
        self,
        context: Sequence[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> _Growth:
        """Grow along one path, one draft step a level (as a chain); at each depth up to
        ``width - 1`` more candidates join as leaves. Nodes are ranked by estimated path
        acceptance (the product of :class:`AcceptanceCalibration` estimates).

        Greedy: the draft's top-``width`` tokens (point masses), the path follows the
        argmax; afterwards the ``budget`` best nodes are kept (ancestor-closed: a path
        never beats its parent), and growth stops once the path cannot place another
        node among them (or after ``depth`` levels, or below ``min_score``).

        Sampling: candidates are drawn without replacement from q and the path follows
        the first draw, so the path alone is an ordinary sampled chain. A sibling group
        must stay a draw-order prefix whose size does not depend on the drawn tokens
        (the verifier's premise), so its size is fixed from q before drawing (siblings
        only where the estimated acceptance of q's argmax is below ``sibling_below``)
        and nothing is pruned afterwards; growth stops at the budget.
        """
        shape = self.tree_shape
        scoring = params if not params.greedy else SamplingParams(temperature=1.0)
        tree = _Growing()
        score: list[float] = []
        ranks: list[int] = []
        probs: list[float] = []
        sequence, parent, parent_score = list(context), -1, 1.0
        for _ in range(shape.depth):
            room = budget if params.greedy else budget - tree.size
            if room <= 0:
                break
            logits = yield _Pass(list(sequence))  # [vocab]
            q = logits_to_probs(fit_vocab(logits, self.vocab_size), scoring)  # [vocab]
            if params.greedy:
                drawn = [t for t in torch.topk(q, min(shape.width, room)).indices.tolist()]
            else:
                sure = self.calibration.estimate(0, float(q.max())) >= shape.sibling_below
                drawn = sample_without_replacement(
                    q, 1 if sure else min(shape.width, room), generator
                )
            level = []
            ceiling = parent_score
            for rank, token in enumerate(drawn):
                prob = float(q[token])
                level.append(tree.add(token, parent, None if params.greedy else q))
                ceiling = min(ceiling, parent_score * self.calibration.estimate(rank, prob))
                score.append(ceiling)
                ranks.append(rank)
                probs.append(prob)
            best = level[0]
            full = len(score) >= budget
            cutoff = sorted(score, reverse=True)[budget - 1] if full and params.greedy else 0.0
            if score[best] <= cutoff or score[best] < shape.min_score:
                break  # no deeper node could enter the budget, or none is likely
            sequence.append(tree.tokens[best])
            parent, parent_score = best, score[best]
        keep = sorted(range(tree.size), key=lambda n: (-score[n], n))[:budget]
        keep = sorted(keep) if params.greedy else list(range(tree.size))
        self._last_tree = RankedTree(
            tokens=[tree.tokens[n] for n in keep],
            parents=[keep.index(tree.parents[n]) if tree.parents[n] >= 0 else -1 for n in keep],
            ranks=[ranks[n] for n in keep],
            probs=[probs[n] for n in keep],
            start=len(context),
        )
        return tree.select(keep, point_mass=params.greedy)


class _Growing:
    """A tree under construction (flat lists)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.q_rows: list[torch.Tensor | None] = []

    @property
    def size(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, q: torch.Tensor | None) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.q_rows.append(q)
        return len(self.tokens) - 1

    def freeze(self, point_mass: bool) -> DraftTree:
        q = None if point_mass or not self.q_rows else torch.stack(self.q_rows)  # [n, V]
        return DraftTree(torch.tensor(self.tokens, dtype=torch.long), torch.tensor(self.parents), q)

    def select(self, nodes: list[int], point_mass: bool) -> DraftTree:
        """The sub-tree of ``nodes`` (sorted, ancestor-closed, draw-order prefixes)."""
        index = {node: i for i, node in enumerate(nodes)}
        parents = [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in nodes]
        tokens = [self.tokens[n] for n in nodes]
        rows = [self.q_rows[n] for n in nodes]
        q = None if point_mass or not rows else torch.stack(rows)  # [n, vocab]
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents), q)


def _model_drafter(ask: RowAsk | TreeAsk) -> DraftModelDrafter:
    drafter = ask.drafter
    assert isinstance(drafter, DraftModelDrafter)
    return drafter


@dataclass
class _Chain:
    """One row's chain while it is drafted: the sequence so far, the drafted tokens and
    their processed rows q ([1, vocab] each)."""

    ask: RowAsk
    drafter: DraftModelDrafter
    sequence: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sequence = list(self.ask.context)

    def step(self, logits: torch.Tensor) -> None:
        """Draw the next draft token from the draft logits [1, draft vocab] after the
        sequence so far."""
        params = self.ask.params
        q = logits_to_probs(fit_vocab(logits, self.drafter.vocab_size), params)  # [1, vocab]
        token = int(q.argmax()) if params.greedy else _draw(q[0], self.ask.generator)
        self.tokens.append(token)
        self.rows.append(q)
        self.sequence.append(token)

    def draft(self) -> Draft:
        probs = torch.stack(self.rows, dim=1) if self.rows else None  # [1, gamma, vocab]
        return Draft(tokens=self.tokens, probs=probs)


def _slot(session: ModelSession | SlotSession) -> SlotSession:
    assert isinstance(session, SlotSession)
    return session


@dataclass
class _Pass:
    """A draft pass a growing tree asks for: the draft logits after ``context`` ([vocab])
    or, with ``tokens``, after it and after each of those tree nodes ([1 + n, vocab])."""

    context: list[int]
    tokens: list[int] | None = None
    parents: list[int] | None = None

    def request(self, session: SlotSession) -> RowInput:
        if self.tokens is None:
            return session.request(self.context)
        assert self.parents is not None
        return session.request_tree(self.context, self.tokens, self.parents)

    def alone(self, session: ModelSession | SlotSession) -> torch.Tensor:
        if self.tokens is None:
            return session.logits_after(self.context)[0, -1]
        assert self.parents is not None
        return session.logits_for_tree(self.context, self.tokens, self.parents)[0]

    def received(self, session: SlotSession, logits: torch.Tensor) -> torch.Tensor:
        out = session.receive(logits)[0]  # [1 + n, vocab]
        return out[-1] if self.tokens is None else out


_Growth = Generator[_Pass, torch.Tensor, DraftTree]  # yields passes, returns the tree


def _grown_alone(session: ModelSession | SlotSession, growth: _Growth) -> DraftTree:
    """Run a growing tree's passes one by one on its own session."""
    try:
        wanted = next(growth)
        while True:
            wanted = growth.send(wanted.alone(session))
    except StopIteration as done:
        return done.value


def _first(growth: _Growth, trees: dict[int, DraftTree], i: int) -> _Pass | None:
    """The first pass a growing tree asks for (None: it is grown, in ``trees[i]``)."""
    try:
        return next(growth)
    except StopIteration as done:
        trees[i] = done.value
        return None


def _send(
    growth: _Growth, logits: torch.Tensor, trees: dict[int, DraftTree], i: int
) -> _Pass | None:
    """Hand a growing tree its pass's logits; its next pass (None: grown, in ``trees[i]``)."""
    try:
        return growth.send(logits)
    except StopIteration as done:
        trees[i] = done.value
        return None


def _draft_pass_for(
    sessions: Sequence[ModelSession | SlotSession], passes: Sequence[_Pass]
) -> list[torch.Tensor]:
    """Each pass's logits (:class:`_Pass`), for rows whose drafters hold slots of one
    draft model: on its own session for one, else one pass over their slots."""
    if len(passes) == 1:
        return [passes[0].alone(sessions[0])]
    slots = [_slot(s) for s in sessions]
    rows = [p.request(s) for p, s in zip(passes, slots, strict=True)]
    outputs = slots[0].model.forward_rows(rows)
    return [p.received(s, out) for p, s, out in zip(passes, slots, outputs, strict=True)]
