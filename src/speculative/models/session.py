"""Keep a model's cache in step with a growing token sequence.

The engine and the model-based drafters never manage cache positions by hand. A
:class:`ModelSession` remembers which token ids its model's cache holds; asked for the
logits after a sequence, it rolls the cache back to the longest common prefix, feeds
whatever is missing (the *catch-up* after a recovered or bonus token), and returns the
logits of the positions asked for. Rollback after a rejection is therefore implicit.

Invariant used by the engine: to score a sequence ``seq`` the cache is made to hold
``seq[:-1]`` and the last token is fed together with any new (drafted) tokens, so one
call returns ``1 + len(new)`` next-token distributions.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import torch

from speculative.capabilities import provides
from speculative.models.base import (
    CausalLM,
    RowInput,
    SharesSlotPrefix,
    SkipsOutputHead,
    SupportsBatchRowFeatures,
    SupportsBatchRows,
    SupportsCacheCompaction,
    SupportsCacheImport,
    SupportsHiddenStates,
    SupportsTreeAttention,
)


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences (token ids, or two strings)."""
    n = min(len(a), len(b))
    if _same(a[:n], b[:n]):
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _same(a[lo:mid], b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def _same(x: Sequence[Any], y: Sequence[Any]) -> bool:
    """Equal elements in order (a list and a tuple alike; strings compared as strings)."""
    return x == y if type(x) is type(y) else list(x) == list(y)


def tree_attention(parents: Sequence[int], catch_up: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and position offsets for ``catch_up`` chain tokens followed by a tree.

    The chain (its last token is the tree's root) is causal; tree node i sees the whole
    chain, its ancestors and itself, and sits one position deeper than its parent.
    returns: mask [k, k] bool, offsets [k] int64 (positions relative to the first fed slot),
    k = catch_up + len(parents). Built in numpy (a tree round's few rows: element writes
    cost a tenth of torch's).
    """
    k = catch_up + len(parents)
    mask = np.zeros((k, k), dtype=bool)
    mask[:catch_up, :catch_up] = np.tri(catch_up, dtype=bool)
    offsets = list(range(catch_up)) + [0] * len(parents)
    for node, parent in enumerate(parents):
        row = catch_up + node
        if parent < 0:
            mask[row, :catch_up] = True
            offsets[row] = catch_up
        else:
            mask[row] = mask[catch_up + parent]
            offsets[row] = offsets[catch_up + parent] + 1
        mask[row, row] = True
    return torch.from_numpy(mask), torch.tensor(offsets, dtype=torch.long)


@dataclass
class _Pending:
    """A planned row between request and receive: the tokens fed and how many of them are
    the chain (the rest is a tree)."""

    tokens: list[int]
    chain: int
    tree: bool = False  # tokens[chain:] are a token tree (possibly empty)
    features: torch.Tensor | None = None  # [k, hidden] when the model gives features
    taken: bool = False  # the chain's features went to the store by reference (take)


# The most passes' features a store references before it copies them (a row that drafts
# nothing for long: each reference keeps its pass's [Σ k, hidden] output alive).
MAX_CHUNKS = 256


@dataclass
class _Chunk:
    """Features of positions [start, start + rows) not yet copied to a store's buffer:
    rows ``first`` .. of a pass's features (kept alive, never copied, until read)."""

    start: int
    features: torch.Tensor  # [Σ k, hidden] the pass's
    first: int
    rows: int


class FeatureStore:
    """The model's features of a cache's first positions, kept in step with its tokens
    (what drafting heads read), plus those of a scored tree's nodes until its path is
    kept.

    A batch's pass hands every row its features as a reference to the pass's output
    (:meth:`take`): copying them to the row's buffer waits until a head reads them
    (:meth:`view`). After a pass the caches are cold (its weights streamed through
    them), and the split and a copy per row and round then cost 1–2 % of a decode step
    at B = 8, paid also by rows that draft nothing (a batch too full to draft); the
    references cost about half of that, and a row that drafts copies each position once
    all the same.
    """

    def __init__(self) -> None:
        self._buffer = torch.empty(0)  # [capacity, hidden]
        self._chunks: list[_Chunk] = []  # positions after the buffer's, in order
        self.length = 0  # positions [0, length) hold valid features
        self.tree: torch.Tensor | None = None  # [n, hidden] features of a scored tree's nodes

    def view(self, cached: int) -> torch.Tensor:
        """[n, hidden] the features of the first n = :meth:`count` positions."""
        self._settle()
        return self._buffer[: self.count(cached)]

    def count(self, cached: int) -> int:
        """How many first positions (of the ``cached`` ones) have features."""
        return min(self.length, cached)

    def truncate(self, keep: int) -> None:
        self.length = min(self.length, keep)
        while self._chunks and self._chunks[-1].start >= keep:
            self._chunks.pop()
        if self._chunks:
            last = self._chunks[-1]
            last.rows = min(last.rows, keep - last.start)

    def forget(self) -> None:
        """Nothing is valid any more (a reset, or a cache taken over without features)."""
        self.length = 0
        self.tree = None
        self._chunks.clear()

    def append(self, start: int, features: torch.Tensor) -> None:
        """features: [k, hidden] of the positions appended at ``start`` (the cache's length
        before them)."""
        k = features.shape[0]
        if self.length < start:  # a gap (adopted cache): nothing before is valid
            self.forget()
            return
        if self._chunks:  # referenced positions first (those from ``start`` on dropped)
            self.truncate(start)
            self._settle()
        if start + k > self._buffer.shape[0]:
            capacity = max(2 * self._buffer.shape[0], start + k, 256)
            grown = torch.empty(capacity, features.shape[1])
            if start:
                grown[:start] = self._buffer[:start]
            self._buffer = grown
        self._buffer[start : start + k] = features
        self.length = start + k

    def take(self, start: int, features: torch.Tensor, first: int, rows: int) -> None:
        """Rows ``first`` .. ``first + rows`` of a pass's ``features`` [Σ k, hidden] are
        positions [start, start + rows): referenced now, copied when read."""
        if self.length != start:
            if self.length < start:  # a gap (adopted cache): nothing before is valid
                self.forget()
                return
            self.truncate(start)
        if len(self._chunks) >= MAX_CHUNKS:  # bound the passes' outputs kept alive
            self._settle()
        self._chunks.append(_Chunk(start, features, first, rows))
        self.length = start + rows

    def _settle(self) -> None:
        """Copy the referenced chunks to the buffer."""
        chunks, self._chunks = self._chunks, []
        for chunk in chunks:
            self.append(chunk.start, chunk.features[chunk.first : chunk.first + chunk.rows])

    def received(self, start: int, features: torch.Tensor | None, pending: _Pending) -> None:
        """A row's pass fed ``pending.tokens`` at ``start`` with these features [k, hidden]
        (None: the pass gave none, or gave them by reference to :meth:`take`): keep the
        chain's, hold the tree's apart."""
        if features is not None and not pending.taken:
            self.append(start, features[: pending.chain])
        self.tree = features[pending.chain :] if pending.tree and features is not None else None

    def keep_path(self, start: int, nodes: Sequence[int]) -> None:
        """The kept tree nodes' features follow them to ``start`` onwards."""
        tree, self.tree = self.tree, None
        if tree is not None:
            self.append(start, tree[list(nodes)])


# The model attribute naming (a weak reference to) the ModelSession whose tokens the
# model's single-sequence cache holds: a session that finds another one named there
# (engines taking turns on one model) starts over from an empty cache instead of trusting
# one it no longer holds.
CACHE_HOLDER = "_speculative_cache_holder"


class ModelSession:
    """A model plus the token ids its cache currently holds (batch of one).

    Several sessions may use one model one after another (engines taking turns): a session
    records itself on the model whenever it starts over from an empty cache
    (:data:`CACHE_HOLDER`), and one that finds another recorded there since forgets what
    it cached and feeds it again."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.cached: list[int] = []
        # the first cached position no chain pass of this model computed (a tree's kept
        # path, an imported cache), None: there is none (see drop_foreign)
        self.foreign_from: int | None = None
        self.forward_calls = 0
        self._tree: list[int] | None = None  # tree tokens fed after ``cached``, not committed
        self._features = FeatureStore()
        self._hidden_model = model if isinstance(model, SupportsHiddenStates) else None
        self._skips_head = model if provides(model, SkipsOutputHead) else None
        self._pending: _Pending | None = None  # the planned row between request and receive
        self.reset()

    @property
    def features(self) -> torch.Tensor | None:
        """[n, hidden] the model's features of the first n cached positions (n <=
        len(cached); all of them unless the cache was adopted), or None when the model
        has no :class:`SupportsHiddenStates` or the session does not keep them
        (:meth:`keep_features`)."""
        if self._hidden_model is None:
            return None
        return self._features.view(len(self.cached))

    @property
    def feature_count(self) -> int:
        """n of :attr:`features` (0 without them), without reading them."""
        return 0 if self._hidden_model is None else self._features.count(len(self.cached))

    def keep_features(self, keep: bool) -> None:
        """Whether this session's passes compute the model's features (drafting heads read
        them; each pass pays a final norm for them). On by default where the model gives
        them. Turning them back on over cached positions that have none starts afresh."""
        hidden = self.model if keep and isinstance(self.model, SupportsHiddenStates) else None
        if hidden is None:
            self._features.forget()
        elif self._hidden_model is None and self._features.length < len(self.cached):
            self.reset()  # the cached positions have no features: recompute them
        self._hidden_model = hidden

    def drop_features(self) -> None:
        """:meth:`keep_features` off (the row's drafter shed them)."""
        self.keep_features(False)

    def reset(self) -> None:
        self.model.reset()
        self.cached, self.foreign_from = [], None
        self._tree = None
        self._pending = None
        self._features.forget()
        setattr(self.model, CACHE_HOLDER, weakref.ref(self))

    def _hold(self) -> None:
        """Start over (an empty cache) unless the model's cache still holds this session's
        tokens: no other session has started over on the model since this one did."""
        holder = getattr(self.model, CACHE_HOLDER, None)
        if holder is None or holder() is not self:
            self.reset()

    def sync(self, prefix: Sequence[int]) -> None:
        """Make the cache hold exactly ``prefix`` (rolling back and feeding as needed)."""
        self._hold()
        self._drop_tree()
        keep = common_prefix_length(self.cached, prefix)
        self._truncate(keep)
        missing = list(prefix[keep:])
        if missing:
            self._feed(missing)

    @property
    def cache_slot(self) -> int | None:
        """Where this session's positions live in its model: the single-sequence cache."""
        return None

    def adopt(self, other: RowSession) -> bool:
        """Take over ``other``'s cached tokens by copying its cache (no forward pass), if
        this model can import that model's cache; returns whether it did. ``other`` is a
        model's single sequence or one cache slot of a batch (a batched row primes its
        drafter exactly as the row alone does)."""
        self._hold()
        self._drop_tree()
        model = self.model
        if not other.cached or not provides(model, SupportsCacheImport):
            return False
        if not model.import_cache(other.model, len(other.cached), other.cache_slot):
            return False
        self.cached = list(other.cached)
        self.foreign_from = 0
        self._features.forget()
        return True

    def logits_after(self, context: Sequence[int], new: Sequence[int] = ()) -> torch.Tensor:
        """Next-token logits after ``context[-1]`` and after each token of ``new``.

        returns: [1, 1 + len(new), vocab]; row 0 is the distribution following ``context``,
        row j the one following ``context + new[:j]``.
        """
        return self.receive(self.run(self.request(context, new)))

    def logits_for_tree(
        self, context: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
    ) -> torch.Tensor:
        """Next-token logits after ``context`` and after the path to each tree node, from one
        forward with a tree attention mask (parents[i] = -1 for children of context[-1]).

        returns: [1, 1 + n, vocab]; row 0 follows ``context``, row i + 1 follows the path to
        node i. The tree stays in the cache until :meth:`keep_path` keeps the accepted
        path; any other call first drops it.
        """
        return self.receive(self.run(self.request_tree(context, tokens, parents)))

    # ---- a batch of one: request -> run -> receive (see RowSession) -------------------
    def request(
        self, context: Sequence[int], new: Sequence[int] = (), every_logit: bool = False
    ) -> RowInput:
        """Plan the pass that scores ``context[-1]`` and each of ``new``: roll the cache back
        to the longest common prefix with ``context[:-1]``; the row feeds the rest.
        ``every_logit``: the row's logits start at its first fed token (a prompt's
        log-probabilities), not at ``context[-1]``."""
        chain = self._rewind(context)
        fed = chain + list(new)
        self._pending = _Pending(fed, chain=len(fed))
        first = 0 if every_logit else len(chain) - 1
        return RowInput(0, torch.tensor(fed, dtype=torch.long), logits_from=first)

    def request_tree(
        self, context: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
    ) -> RowInput:
        """Plan the tree pass of :meth:`logits_for_tree` (catch-up chain, then the tree)."""
        if not provides(self.model, SupportsTreeAttention):
            raise ValueError(f"{type(self.model).__name__} cannot score a token tree in one pass")
        chain = self._rewind(context)  # catch-up tokens, the root last
        mask, offsets = tree_attention(parents, len(chain))  # [k, k], [k]
        fed = chain + list(tokens)
        self._pending = _Pending(fed, chain=len(chain), tree=True)
        ids = torch.tensor(fed, dtype=torch.long)  # [k]
        return RowInput(0, ids, mask, len(self.cached) + offsets, len(chain) - 1)

    def run(self, row: RowInput) -> torch.Tensor:
        """The model's forward over the planned row: [k - logits_from, vocab] logits."""
        if self._pending is None:
            raise ValueError("run without a request")
        input_ids = row.input_ids.reshape(1, -1)  # [1, k]
        if self._skips_head is not None:  # the output head only where logits are wanted
            logits, features = self._skips_head.forward_from(
                input_ids, row.logits_from, row.attention_mask, row.position_ids,
                hidden=self._hidden_model is not None,
            )  # fmt: skip
            if features is not None:
                self._pending.features = features[0]
            self.forward_calls += 1
            return logits[0]
        if self._hidden_model is not None:
            logits, features = self._hidden_model.forward_with_hidden(
                input_ids, row.attention_mask, row.position_ids
            )  # [1, k, vocab], [1, k, hidden]
            self._pending.features = features[0]
        elif row.attention_mask is not None:
            assert provides(self.model, SupportsTreeAttention)  # request_tree checked
            logits = self.model.forward_tree(input_ids, row.attention_mask, row.position_ids)
        else:
            logits = self.model.forward(input_ids)  # [1, k, vocab]
        self.forward_calls += 1
        return logits[0, row.logits_from :]

    def receive(self, logits: torch.Tensor) -> torch.Tensor:
        """Commit the planned row to the bookkeeping; its logits [k - logits_from, vocab]
        (the positions asked for, as :meth:`run` gives them) -> [1, 1 + len(new), vocab]."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise ValueError("receive without a request")
        self._features.received(len(self.cached), pending.features, pending)
        self.cached.extend(pending.tokens[: pending.chain])
        if pending.tree:  # kept apart until keep_path
            self._tree = pending.tokens[pending.chain :]
        return logits.unsqueeze(0)

    def release(self) -> None:
        """Nothing to free: the session keeps its cache for the next generation."""

    def _rewind(self, context: Sequence[int]) -> list[int]:
        """Drop any scored tree, keep the common prefix with ``context[:-1]``; returns the
        tokens of ``context`` still to feed (the last one included)."""
        if len(context) == 0:
            raise ValueError("context must hold at least one token")
        self._hold()
        self._drop_tree()
        keep = common_prefix_length(self.cached, context[:-1])
        self._truncate(keep)
        return list(context[keep:])

    def keep_path(self, nodes: Sequence[int]) -> None:
        """Commit the accepted path (node indices, root to leaf) of the last scored tree:
        compact the cache to it, or drop the tree when the model cannot compact (the
        path is then re-fed as catch-up on the next call)."""
        if self._tree is None:
            raise ValueError("keep_path without a scored tree")
        tree, first = self._tree, len(self.cached)
        self._tree = None
        if provides(self.model, SupportsCacheCompaction):
            self.model.keep_slots(first, [first + i for i in nodes])
            self._features.keep_path(first, nodes)
            self.cached.extend(tree[i] for i in nodes)
            if nodes and self.foreign_from is None:
                self.foreign_from = first
        else:
            self._features.tree = None
            self.model.rollback(len(tree))

    def _drop_tree(self) -> None:
        if self._tree is not None:
            self.model.rollback(len(self._tree))
            self._tree, self._features.tree = None, None

    def _truncate(self, keep: int) -> None:
        drop = len(self.cached) - keep
        if drop:
            self.model.rollback(drop)
            del self.cached[keep:]
            self._features.truncate(keep)
            if self.foreign_from is not None and self.foreign_from >= keep:
                self.foreign_from = None

    def drop_foreign(self) -> None:
        """Forget the cached positions from the first one that no chain pass of this
        model computed (:attr:`foreign_from`): a new generation then computes them as its
        own prefill would, bit for bit (a tree pass's keys and values may differ from a
        chain pass's in the last bits: the PyTorch decoder's attention runs over other
        cache slots)."""
        self._drop_tree()
        if self.foreign_from is not None:
            self._truncate(self.foreign_from)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([tokens], dtype=torch.long)  # [1, k]
        if self._hidden_model is not None:
            logits, features = self._hidden_model.forward_with_hidden(input_ids)
            self._features.append(len(self.cached), features[0])  # features: [1, k, hidden]
        else:
            logits = self.model.forward(input_ids)  # [1, k, vocab]
        self.cached.extend(tokens)
        self.forward_calls += 1
        return logits


class SlotSession:
    """One cache slot of a :class:`SupportsBatchRows` model plus the token ids it holds:
    :class:`ModelSession`'s bookkeeping for one row of a batched forward.

    :meth:`request` (or :meth:`request_tree`) plans the row (rollback to the common
    prefix, catch-up + new tokens); the caller runs every row's request in one
    ``forward_rows`` call and hands this row's logits back to :meth:`receive`.
    """

    def __init__(
        self, model: SupportsBatchRows, features: bool = False, slot: int | None = None
    ) -> None:
        """``slot``: that free slot of a :class:`SharesSlotPrefix` model (a row starting
        from what it retains), else any free one."""
        self.model = model
        if slot is None:
            self.slot = model.acquire_slot()
        else:
            cast(SharesSlotPrefix, model).reacquire_slot(slot)
            self.slot = slot
        # the acquisition whose positions the slot holds (SharesSlotPrefix.holder)
        self.holder = model.holder(self.slot) if provides(model, SharesSlotPrefix) else 0
        self.cached: list[int] = []
        # the first cached position no chain pass of this model computed (a tree pass's,
        # kept by keep_path, or one imported from another model), None: there is none
        self.foreign_from: int | None = None
        self.released = False
        self._pending: _Pending | None = None
        self._tree: list[int] | None = None  # tree tokens fed after ``cached``, not committed
        self._features = FeatureStore() if features else None
        self.forward_calls = 0  # passes this row took part in

    @property
    def keeps_features(self) -> bool:
        return self._features is not None

    def drop_features(self) -> None:
        """Keep no more features (the row's drafter shed them): passes with this row
        alone copy none out."""
        self._features = None

    @property
    def cache_slot(self) -> int | None:
        """Where this session's positions live in its model: its cache slot."""
        return self.slot

    @property
    def features(self) -> torch.Tensor | None:
        """[n, hidden] the model's features of the first n cached positions, or None when
        the pool's passes give no features (see :meth:`ModelSession.features`)."""
        if self._features is None:
            return None
        return self._features.view(len(self.cached))

    @property
    def feature_count(self) -> int:
        """n of :attr:`features` (0 without them), without reading them."""
        return 0 if self._features is None else self._features.count(len(self.cached))

    def shareable(self, prefix: Sequence[int], features: bool) -> int:
        """How many first positions of ``prefix`` another slot may copy from this one:
        cached positions that chain passes computed (prompt chunks and rounds: bit for bit
        what the copy's own prefill would compute, the kernels being k-invariant; not
        those a tree pass wrote, whose attention ran over other cache slots), with their
        features when ``features``. A conversation's next turn so finds the last turn's
        prompt and reply."""
        n = common_prefix_length(self.cached, prefix)
        if self.foreign_from is not None:
            n = min(n, self.foreign_from)
        if features:
            n = min(n, self._features.length if self._features is not None else 0)
        if self.released:  # what the slot still holds of this row
            n = min(n, self.model.retained(self.slot, self.holder))
        return n

    def adopt_prefix(self, donor: SlotSession, length: int) -> None:
        """Start this (empty) slot from ``donor``'s first ``length`` positions: keys,
        values and features copied, not computed."""
        self.model.copy_slot_prefix(donor.slot, self.slot, length)
        self.cached = donor.cached[:length]
        self.foreign_from = None  # (a donor shares only what its chain passes computed)
        if self._features is not None:
            assert donor.features is not None
            self._features.append(0, donor.features[:length])

    def take_features(self, features: torch.Tensor, first: int) -> None:
        """The planned row's features are rows ``first`` .. of the pass's ``features``
        [Σ k, hidden] (given before :meth:`receive` gets the row's logits): the chain's go
        to the store by reference; a tree's nodes' it holds apart until its path is
        kept."""
        pending = self._pending
        if pending is None:
            raise ValueError("features without a request")
        assert self._features is not None
        self._features.take(len(self.cached), features, first, pending.chain)
        pending.taken = True
        if pending.tree:
            pending.features = features[first : first + len(pending.tokens)]

    def request(
        self, context: Sequence[int], new: Sequence[int] = (), every_logit: bool = False
    ) -> RowInput:
        """The row that scores ``context[-1]`` and each of ``new`` (the logits of
        :meth:`ModelSession.logits_after`; ``every_logit``: as :meth:`ModelSession.request`)."""
        chain = self._rewind(context)
        fed = chain + list(new)
        self._pending = _Pending(fed, chain=len(fed))
        first = 0 if every_logit else len(chain) - 1
        return RowInput(self.slot, torch.tensor(fed, dtype=torch.long), logits_from=first)

    def request_tree(
        self, context: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
    ) -> RowInput:
        """The row that scores a token tree after ``context`` (the logits of
        :meth:`ModelSession.logits_for_tree`), with its tree mask and depth positions."""
        chain = self._rewind(context)
        mask, offsets = tree_attention(parents, len(chain))  # [k, k], [k]
        fed = chain + list(tokens)
        self._pending = _Pending(fed, chain=len(chain), tree=True)
        ids = torch.tensor(fed, dtype=torch.long)  # [k]
        return RowInput(self.slot, ids, mask, len(self.cached) + offsets, len(chain) - 1)

    def receive(self, logits: torch.Tensor) -> torch.Tensor:
        """This row's logits from forward_rows ([k - logits_from, vocab]: the positions
        asked for) -> [1, 1 + len(new), vocab]."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise ValueError("receive without a request")
        self.forward_calls += 1
        if self._features is not None:
            self._features.received(len(self.cached), pending.features, pending)
        self.cached.extend(pending.tokens[: pending.chain])
        if pending.tree:  # kept apart until keep_path
            self._tree = pending.tokens[pending.chain :]
        return logits.unsqueeze(0)

    def keep_path(self, nodes: Sequence[int]) -> None:
        """Commit the accepted path (node indices, root to leaf) of the last scored tree
        by compacting the slot's cache to it."""
        if self._tree is None:
            raise ValueError("keep_path without a scored tree")
        tree, first, self._tree = self._tree, len(self.cached), None
        self.model.keep_slot_positions(self.slot, first, [first + i for i in nodes])
        if self._features is not None:
            self._features.keep_path(first, nodes)
        self.cached.extend(tree[i] for i in nodes)
        if nodes:
            self._mark_foreign(first)

    def release(self) -> None:
        """Free the slot at once (the session cannot be used afterwards; what it cached
        stays readable, for a later row to share while the slot retains it)."""
        self.model.release_slot(self.slot)
        self.released = True
        self._tree = None

    def _rewind(self, context: Sequence[int]) -> list[int]:
        if len(context) == 0:
            raise ValueError("context must hold at least one token")
        if self._tree is not None:
            self.model.rollback_slot(self.slot, len(self._tree))
            self._tree = None
        keep = common_prefix_length(self.cached, context[:-1])
        drop = len(self.cached) - keep
        if drop:
            self.model.rollback_slot(self.slot, drop)
            del self.cached[keep:]
            if self.foreign_from is not None and self.foreign_from >= keep:
                self.foreign_from = None  # what a tree wrote or another model gave is gone
        if self._features is not None:
            self._features.truncate(keep)
            self._features.tree = None
        return list(context[keep:])

    # ---- one row on its own: ModelSession's calls, for a drafter's own slot ------------
    def reset(self) -> None:
        """Forget every cached position (the slot stays held)."""
        self._tree = None
        self.model.rollback_slot(self.slot, self.model.slot_length(self.slot))
        self.cached, self.foreign_from = [], None
        if self._features is not None:
            self._features.truncate(0)

    def logits_after(self, context: Sequence[int], new: Sequence[int] = ()) -> torch.Tensor:
        """:meth:`ModelSession.logits_after` on this slot alone: [1, 1 + len(new), vocab]."""
        return self.receive(self.model.forward_rows([self.request(context, new)])[0])

    def logits_for_tree(
        self, context: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
    ) -> torch.Tensor:
        """:meth:`ModelSession.logits_for_tree` on this slot alone."""
        row = self.request_tree(context, tokens, parents)
        return self.receive(self.model.forward_rows([row])[0])

    def follow(self, other: RowSession, context: Sequence[int]) -> int:
        """Copy into this slot the positions of ``context`` (all but its last token, which
        a request feeds) that ``other`` holds and this slot does not, keeping what this
        slot already holds of ``context``: for a model whose keys and values mean what
        ``other``'s do (an early exit of ``other``'s model: bitwise; the same model at
        another precision: rounded otherwise), a catch-up without a pass.
        Returns the positions copied (0 where the model cannot import ``other``'s)."""
        if isinstance(other, SlotSession) and other.released:
            return 0
        self._rewind(context)  # keeps the common prefix of this slot and context[:-1]
        keep, usable = len(self.cached), common_prefix_length(other.cached, context[:-1])
        if usable <= keep or not provides(self.model, SupportsCacheImport):
            return 0
        if not self.model.import_cache(
            other.model, usable, other.cache_slot, self.slot, start=keep
        ):
            return 0
        self.cached.extend(context[keep:usable])
        self._mark_foreign(keep)
        return usable - keep

    def adopt(self, other: RowSession) -> bool:
        """:meth:`ModelSession.adopt` into this slot: ``other``'s cached positions copied
        (no forward), if this model can import that model's cache."""
        self.reset()
        model = self.model
        if not other.cached or not provides(model, SupportsCacheImport):
            return False
        if not model.import_cache(other.model, len(other.cached), other.cache_slot, self.slot):
            return False
        self.cached = list(other.cached)
        self._mark_foreign(0)
        return True

    def _mark_foreign(self, first: int) -> None:
        """Positions from ``first`` on were not computed by this model's chain passes."""
        self.foreign_from = first if self.foreign_from is None else min(first, self.foreign_from)


# ---- where rows live: one model's slots, or a single-sequence model (batch of one) ------


@runtime_checkable
class FeatureSource(Protocol):
    """What a drafting head reads from the target's side: the token ids its cache holds
    and the features of the first of them (None when the passes give no features)."""

    cached: list[int]

    @property
    def features(self) -> torch.Tensor | None: ...

    @property
    def feature_count(self) -> int:
        """How many first cached positions have features (the rows of ``features``; 0
        without them), without reading them."""
        ...


@runtime_checkable
class RowSession(FeatureSource, Protocol):
    """One row's view of the target's cache (:class:`ModelSession` or
    :class:`SlotSession`): plan a row, get its logits back from the shared pass."""

    model: object  # the model whose cache holds the row

    @property
    def cache_slot(self) -> int | None:
        """The row's cache slot in ``model`` (None: its single-sequence cache)."""
        ...

    def request(
        self, context: Sequence[int], new: Sequence[int] = (), every_logit: bool = False
    ) -> RowInput: ...

    def request_tree(
        self, context: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
    ) -> RowInput: ...

    def receive(self, logits: torch.Tensor) -> torch.Tensor: ...

    def keep_path(self, nodes: Sequence[int]) -> None: ...

    def drop_features(self) -> None:
        """Stop keeping the target's features for this row (its drafter shed them)."""
        ...

    def release(self) -> None: ...

    def reset(self) -> None:
        """Forget every cached position (the row then prefills its whole prompt)."""
        ...


class RowPool(Protocol):
    """Opens row sessions on a target and runs all their planned rows in one pass."""

    @property
    def capacity(self) -> int | None:
        """Most rows open at once (None: as many as the model has slots)."""
        ...

    def open(self, features: bool = False, prompt: Sequence[int] = ()) -> RowSession:
        """A new row's session; ValueError when no room is left. ``features``: the row's
        drafter reads the target's features (a pool may compute them only for such rows).
        ``prompt``: the row's prompt (a pool may start the cache from a live row's)."""
        ...

    def forward_rows(self, rows: Sequence[RowInput]) -> list[torch.Tensor]:
        """Every planned row through one target pass; [k_row, vocab] logits each."""
        ...

    def forget_finished(self) -> None:
        """Let no later row start from what finished rows left in the cache (their
        prompts and outputs are computed again: a cold cache, as for benchmarks)."""
        ...


# the share of a finished row's cached positions a new row must start from to take that
# row's slot itself (else it copies them into another slot)
IN_PLACE_SHARE = 0.75


class SlotPool:
    """Rows in the cache slots of a :class:`SupportsBatchRows` model: one weight pass for
    every row's tokens. When the model gives every row's features
    (:class:`SupportsBatchRowFeatures`), each row's session keeps them for drafting heads."""

    capacity: int | None = None

    def __init__(self, model: SupportsBatchRows) -> None:
        self.model = model
        self.gives_features = provides(model, SupportsBatchRowFeatures)
        self._sessions: dict[int, SlotSession] = {}  # by slot: the row that owns it now

    def open(self, features: bool = False, prompt: Sequence[int] = ()) -> SlotSession:
        """A session on a free slot. With a model that shares slot prefixes, a prompt
        whose first tokens a row's prefill already cached (a live row, or a finished one
        whose slot still holds them) starts from a copy of them
        (bit for bit what its own prefill would compute: the kernels' results do not
        depend on the other rows or tokens of a pass)."""
        wanted = features and self.gives_features
        donor, length = self._donor(list(prompt[:-1]), wanted)
        session = self._new_session(donor, length, wanted)  # raises when no slot is free
        if donor is not None:
            session.adopt_prefix(donor, length)
        self._sessions[session.slot] = session
        return session

    def forget_finished(self) -> None:
        """See :meth:`RowPool.forget_finished`."""
        self._sessions = {slot: s for slot, s in self._sessions.items() if not s.released}

    def _new_session(self, donor: SlotSession | None, length: int, features: bool) -> SlotSession:
        """A session on the donor's own slot where the donor is a finished row whose slot
        is still free and the new row shares most of what it holds (a conversation's next
        turn: it starts from those positions in place, and the other slots keep what they
        retain), else on any free slot (a row sharing only an opening copies it, and the
        donor keeps the rest for its own next turn)."""
        in_place = length >= IN_PLACE_SHARE * len(donor.cached) if donor is not None else False
        if in_place and donor.released and self._sessions.get(donor.slot) is donor:
            try:
                return SlotSession(self.model, features, donor.slot)
            except ValueError:  # taken outside this pool
                pass
        return SlotSession(self.model, features)

    def _donor(self, prefix: list[int], features: bool) -> tuple[SlotSession | None, int]:
        """The session (live, or finished with its slot's positions retained) with the
        most of ``prefix`` to share, and how much."""
        if not prefix or not provides(self.model, SharesSlotPrefix):
            return None, 0
        best, length = None, 0
        for session in self._sessions.values():
            n = session.shareable(prefix, features)
            if n > length:
                best, length = session, n
                if length == len(prefix):  # no session can share more
                    break
        return best, length

    def forward_rows(self, rows: Sequence[RowInput]) -> list[torch.Tensor]:
        """One pass for every row; features only when some row of it keeps them."""
        sessions = [self._sessions[row.slot] for row in rows]
        if not any(session.keeps_features for session in sessions):
            return self.model.forward_rows(rows)
        assert provides(self.model, SupportsBatchRowFeatures)
        logits, features = self.model.forward_rows_with_hidden(rows)  # [Σ k, hidden]
        self._keep_features(sessions, rows, features)
        return logits

    def _keep_features(
        self, sessions: list[SlotSession], rows: Sequence[RowInput], features: torch.Tensor
    ) -> None:
        """The pass's features [Σ k, hidden] to the sessions that keep them (each its rows
        of it)."""
        first = 0
        for session, row in zip(sessions, rows, strict=True):
            if session.keeps_features:
                session.take_features(features, first)
            first += row.input_ids.shape[0]


class SinglePool:
    """One row on any :class:`CausalLM`'s own cache, through a :class:`ModelSession`:
    the single-sequence engine is a batch of one over the same round code."""

    capacity: int | None = 1

    def __init__(self, session: ModelSession) -> None:
        self.session = session
        self._forget = False  # forget_finished was asked: the next open starts over

    def open(self, features: bool = False, prompt: Sequence[int] = ()) -> ModelSession:
        """The session, for a new generation: it keeps what chain passes cached (the last
        generation's prompt and output, for a next turn's prompt to start from)."""
        self.session._hold()  # what it cached is gone if another session took the model
        if self._forget:
            self.session.reset()
            self._forget = False
        self.session.drop_foreign()
        self.session.keep_features(features)
        return self.session

    def forget_finished(self) -> None:
        """See :meth:`RowPool.forget_finished`: the next row starts from an empty cache
        (a live row keeps its own)."""
        self._forget = True

    def forward_rows(self, rows: Sequence[RowInput]) -> list[torch.Tensor]:
        if len(rows) != 1:
            raise ValueError(f"a single-sequence model runs one row per pass, got {len(rows)}")
        return [self.session.run(rows[0])]
