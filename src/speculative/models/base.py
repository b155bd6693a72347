"""The model protocol the engine drives: a causal LM with a rollback-able KV cache.

A model holds a cache of the tokens it has already processed. ``forward`` appends a
block of new tokens and returns next-token logits for each of them; ``rollback`` drops
the newest cache positions (after a rejection). Both the target and a draft model are
objects of this protocol, so the toy Markov models, Hugging Face transformers and the
native runtime are interchangeable under the engine.

Batch-first throughout: ``input_ids`` is ``[batch, k]`` and logits are
``[batch, k, vocab]``; a single sequence is a batch of one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from speculative.sampling.probs import RowProbs


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model with a position-indexed cache that can roll back."""

    @property
    def vocab_size(self) -> int:
        """Number of rows of the output distribution (may include padding rows)."""
        ...

    @property
    def max_length(self) -> int | None:
        """Longest sequence (cache + new tokens) the model accepts, or ``None``."""
        ...

    @property
    def cache_length(self) -> int:
        """Number of positions currently held in the cache."""
        ...

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Append ``input_ids`` to the cache and return their logits.

        input_ids: [batch, k] token ids, placed at positions cache_length .. cache_length+k-1.
        returns:   [batch, k, vocab] float logits; row j is the distribution of the token
                   that follows input_ids[:, j].
        """
        ...

    def rollback(self, n: int) -> None:
        """Drop the newest ``n`` cache positions (0 <= n <= cache_length)."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...


@runtime_checkable
class SupportsEarlyExit(Protocol):
    """A model that can run only its first layers over the same weights (early exit)."""

    @property
    def num_layers(self) -> int: ...

    def early_exit(self, num_layers: int) -> CausalLM: ...


@runtime_checkable
class SupportsWeightBytes(Protocol):
    """A model that knows how many bytes of weights one decode step reads."""

    def weight_bytes(self) -> int: ...


@runtime_checkable
class SupportsCacheImport(Protocol):
    """A model that can take over another model's cached positions.

    Used by draft models that are the target at another precision: instead of running
    their own prefill over the prompt, they copy the target's keys and values (the
    drafts change slightly, the target's output distribution does not). An early exit of
    the target (its first layers, the same weights) copies the keys and values it would
    have computed itself, bitwise, so it can follow the target without any catch-up pass.
    """

    def import_cache(
        self,
        source: object,
        length: int,
        source_slot: int | None = None,
        slot: int | None = None,
        start: int = 0,
    ) -> bool:
        """Make this cache hold ``source``'s first ``length`` positions: of its
        single-sequence cache, or of its cache slot ``source_slot`` (a batched row); in
        this model's single-sequence cache, or in its cache slot ``slot``. With ``start``,
        this cache's first ``start`` positions are kept (they must be held) and only the
        rest are copied. False (and no change) when ``source`` has another architecture
        or cache layout."""
        ...


@runtime_checkable
class SupportsTreeAttention(Protocol):
    """A model that can score a token tree in one forward (tree verification)."""

    def forward_tree(
        self,
        input_ids: torch.Tensor,  # [1, k] int64
        attention_mask: torch.Tensor,  # [k, k] bool, True = new token i may attend new j
        position_ids: torch.Tensor,  # [k] int64 RoPE positions (depth-based for a tree)
    ) -> torch.Tensor:
        """Like ``forward`` (appends k slots, returns [1, k, vocab] logits) but new token i
        sees the cache and the new tokens j with ``attention_mask[i, j]``."""
        ...


@runtime_checkable
class SupportsCacheCompaction(Protocol):
    """A model that can keep chosen cache slots (the accepted path of a verified tree)."""

    def keep_slots(self, first: int, slots: Sequence[int]) -> None:
        """Keep slots [0, first), then move slots ``slots`` (increasing, each >= first) to
        first, first + 1, ...; the cache then holds first + len(slots) positions."""
        ...


@dataclass(frozen=True)
class RowInput:
    """One sequence's new tokens in a ragged batched forward (:class:`SupportsBatchRows`)."""

    slot: int  # the cache slot (sequence) they extend
    input_ids: torch.Tensor  # [k] int64, k >= 1
    attention_mask: torch.Tensor | None = None  # [k, k] bool, True = may attend; None: causal
    position_ids: torch.Tensor | None = None  # [k] int64; None: slot length + arange(k)
    # the first token whose logits are wanted (0 <= logits_from < k): the row's logits are
    # [k - logits_from, vocab], and a model may skip its output head for the tokens before
    # (a prompt's prefill wants only its last token's)
    logits_from: int = 0


@runtime_checkable
class SupportsBatchRows(Protocol):
    """A model holding several independent sequences ("slots"), each with its own cache
    length, that runs all their new tokens in one forward.

    A slot is owned from :meth:`acquire_slot` to :meth:`release_slot`; no two owners share
    one. A row's logits do not depend on the other rows of the call.
    """

    def acquire_slot(self) -> int:
        """An empty free slot, now owned by the caller; ValueError when none is free."""
        ...

    def release_slot(self, slot: int) -> None:
        """Empty ``slot`` and free it."""
        ...

    def slot_length(self, slot: int) -> int:
        """Positions cached in ``slot``."""
        ...

    def rollback_slot(self, slot: int, n: int) -> None:
        """Drop the newest ``n`` positions of ``slot``."""
        ...

    def keep_slot_positions(self, slot: int, first: int, positions: Sequence[int]) -> None:
        """Tree compaction within one slot (see :meth:`SupportsCacheCompaction.keep_slots`)."""
        ...

    def forward_rows(self, rows: Sequence[RowInput]) -> list[torch.Tensor]:
        """Append every row's tokens to its slot (each slot at most once per call);
        returns each row's logits from its ``logits_from`` on, [k_row - logits_from, vocab]
        float."""
        ...


@runtime_checkable
class ReservesSlots(Protocol):
    """A :class:`SupportsBatchRows` model that can size its cache for ``count`` rows in
    one allocation: rows acquired one by one would regrow it (and copy what it holds)
    while the first batch decodes."""

    def reserve_slots(self, count: int) -> None:
        """Hold room for ``count`` slots now (as many of them as the model can hold:
        :meth:`~SupportsBatchRows.acquire_slot` refuses the rest)."""
        ...


@runtime_checkable
class PadsBatchRows(Protocol):
    """A :class:`SupportsBatchRows` model whose pass pads every row to the longest one (the
    transformers runtime): its cost grows with rows × the longest row's tokens, not with
    the total tokens of the pass."""

    def padded_tokens(self, row_lengths: Sequence[int]) -> int:
        """Token positions one pass computes for rows of these lengths."""
        ...


def check_context(requested: int | None, own: int | None) -> int | None:
    """The context window a model runs: ``requested`` (positive, at most the model's
    ``own`` context length where it names one), or by default ``own``."""
    if requested is None:
        return own
    if requested < 1:
        raise ValueError(f"the context window must be positive, got {requested}")
    if own is not None and requested > own:
        raise ValueError(f"a context of {requested} tokens is longer than the model's own ({own})")
    return requested


def check_logits_from(logits_from: int, k: int) -> None:
    """Validate a row's ``logits_from`` (:class:`RowInput`) for ``k`` new tokens."""
    if not 0 <= logits_from < k:
        raise ValueError(f"logits_from must lie in [0, {k}) for {k} tokens, got {logits_from}")


def check_keep_slots(first: int, slots: Sequence[int], length: int) -> list[int]:
    """Validate a keep_slots request against a cache of ``length`` slots."""
    kept = [int(s) for s in slots]
    if not 0 <= first <= length:
        raise ValueError(f"first must lie in [0, {length}], got {first}")
    if any(b <= a for a, b in itertools.pairwise(kept)):
        raise ValueError(f"slots must be strictly increasing, got {kept}")
    if kept and (kept[0] < first or kept[-1] >= length):
        raise ValueError(f"slots must lie in [{first}, {length}), got {kept}")
    return kept


@runtime_checkable
class SupportsHiddenStates(Protocol):
    """A model that also returns its features: the final hidden state of every position.

    The feature is the output head's input (after the final norm), so the model's logits
    are ``features @ output_embedding().T`` up to the head's precision. Drafting heads
    (EAGLE, Medusa) read it instead of running a second model.
    """

    @property
    def hidden_size(self) -> int: ...

    def forward_with_hidden(
        self,
        input_ids: torch.Tensor,  # [batch, k] int64
        attention_mask: torch.Tensor | None = None,  # [k, k] bool: a tree (see forward_tree)
        position_ids: torch.Tensor | None = None,  # [k] int64 RoPE positions, with the mask
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``forward`` (or ``forward_tree`` given a mask, where the model supports
        trees); returns (logits [batch, k, vocab], features [batch, k, hidden]), both
        float32."""
        ...

    def input_embedding(self) -> torch.Tensor:
        """The token embedding table, [vocab, hidden] float32 (read-only)."""
        ...

    def output_embedding(self) -> torch.Tensor:
        """The output head's weight, [vocab, hidden] float32 (read-only)."""
        ...


@runtime_checkable
class SupportsLayerFeatures(Protocol):
    """A :class:`SupportsHiddenStates` model whose features can also carry the residual
    stream after chosen middle layers (EAGLE-3 fuses a low, a middle and a high layer's
    states: the last layer's feature is specialised to the next token, earlier ones keep
    more of the context a drafting head needs for the tokens after it).

    After ``set_feature_layers(layers)`` every feature the model returns
    (``forward_with_hidden``, ``forward_rows_with_hidden``) is
    [..., hidden * (1 + len(layers))]: the usual feature (the output head's input) first,
    then the residual stream after each of ``layers`` (0-based, increasing, below the last
    layer) in order. Logits are unchanged, bit for bit; ``()`` restores plain features.
    """

    @property
    def num_layers(self) -> int: ...

    @property
    def feature_layers(self) -> tuple[int, ...]: ...

    def set_feature_layers(self, layers: Sequence[int]) -> None: ...


def check_feature_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """``layers`` as a tuple, or ValueError unless increasing indices of middle layers
    (0 <= layer < num_layers - 1: the last layer's state is the usual feature)."""
    chosen = tuple(int(layer) for layer in layers)
    if list(chosen) != sorted(set(chosen)) or any(not 0 <= x < num_layers - 1 for x in chosen):
        raise ValueError(
            f"feature layers must be increasing indices in [0, {num_layers - 1}) for a "
            f"{num_layers}-layer model, got {list(chosen)}"
        )
    return chosen


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers (2, L / 2, L - 3 of L), kept below the last
    layer and without repeats: (2, 15, 27) for the default model's 30 layers."""
    wanted = {min(2, num_layers - 2), num_layers // 2, num_layers - 3}
    return tuple(sorted(x for x in wanted if 0 <= x < num_layers - 1))


@runtime_checkable
class SharesSlotPrefix(Protocol):
    """A :class:`SupportsBatchRows` model that can start a slot from another slot's first
    positions: a row whose prompt begins as a live row's did copies those keys and values
    instead of prefilling them (prefix sharing: a shared system prompt, or the many
    continuations of one prompt that ``speculative check`` draws), also from a finished
    row's slot until it is written again."""

    def copy_slot_prefix(self, source: int, target: int, length: int) -> None:
        """Make the empty, acquired slot ``target`` hold the first ``length`` positions of
        ``source`` (a live slot, or one whose last owner's positions are :meth:`retained`;
        ``target`` itself then needs no copy), bit for bit."""
        ...

    def holder(self, slot: int) -> int:
        """The acquisition (``acquire_slot``) that holds ``slot``, or held it last: a number
        no other acquisition of any slot of this model gets."""
        ...

    def retained(self, slot: int, holder: int) -> int:
        """Positions of a released slot (or a re-acquired one not yet written) that still
        hold the keys and values acquisition ``holder`` left there: a later row may start
        from them (none once another acquisition has written the slot)."""
        ...

    def reacquire_slot(self, slot: int) -> None:
        """Acquire the free ``slot`` itself (as :meth:`SupportsBatchRows.acquire_slot`
        acquires one): a row that starts from the positions it retains then needs no
        copy. ValueError when it is not free."""
        ...


@runtime_checkable
class SupportsBatchRowFeatures(Protocol):
    """A :class:`SupportsBatchRows` model that also returns every row's features (as
    :class:`SupportsHiddenStates` does for one sequence): drafting heads then draft for
    every row of a batch."""

    def forward_rows_with_hidden(
        self, rows: Sequence[RowInput]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """As ``forward_rows`` (per row logits [k_row - logits_from, vocab]), with the
        pass's features [Σ k_row, hidden]: every row's, in the order of ``rows``, each
        the row's own alone; both float32."""
        ...


@runtime_checkable
class SkipsOutputHead(Protocol):
    """A model whose single-sequence pass can leave its output head out for the first
    tokens: a prompt's prefill wants only its last token's logits, and the head is a fifth
    of a token's work at SmolLM2-135M's shapes (a 49,152-row head over a 576-wide model)."""

    def forward_from(
        self,
        input_ids: torch.Tensor,  # [1, k] int64
        logits_from: int,  # the first token whose logits are wanted, 0 <= logits_from < k
        attention_mask: torch.Tensor | None = None,  # [k, k] bool (a tree), None: causal
        position_ids: torch.Tensor | None = None,  # [k] int64, with the mask
        hidden: bool = False,  # also the features of all k tokens
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``forward`` / ``forward_tree`` / ``forward_with_hidden``: (logits [1, k -
        logits_from, vocab] float32, features [1, k, hidden] float32 when ``hidden``, else
        None)."""
        ...


@runtime_checkable
class SupportsFusedArgmax(Protocol):
    """A model whose forward also takes each logits row's argmax while computing the row
    (the native C kernels), so greedy verification need not read the logits again."""

    def argmax_rows(self, logits: torch.Tensor) -> list[int] | None:
        """[..., n, vocab] rows of the last forward's logits (any slice of consecutive
        rows the sessions hand on) -> each row's argmax in row order,
        ``logits.argmax(-1).flatten().tolist()``; None when ``logits`` are not such rows
        or the forward did not compute them."""
        ...


@runtime_checkable
class SupportsNucleusSearch(Protocol):
    """A model that finds a logits row's top-p distribution in compiled code (the native C
    kernels): one call where the sampling layer takes a softmax, a search over the
    vocabulary and a renormalization. Its answers are the sampling layer's own rows, or
    None."""

    def nucleus(self, logits: torch.Tensor, temperature: float, top_p: float) -> RowProbs | None:
        """A :data:`~speculative.sampling.probs.NucleusSearch`: [vocab] float32 raw logits
        -> the renormalized nucleus (``row_probs``'s row), or None (not found here)."""
        ...


@runtime_checkable
class SupportsKernels(Protocol):
    """A model whose layers may run on the native C kernels (:mod:`..native.ckernels`).

    Drafting heads ask it for the library to run their own small layers with the target's
    kernels; ``speculative profile`` asks it for the roofline's work counts."""

    def kernel_library(self) -> object | None:
        """The loaded kernel library (a ctypes CDLL) running this model's layers, or None
        when this instance runs on another decoder (the PyTorch fallback)."""
        ...

    def kernel_work(self) -> dict[str, int] | None:
        """Per-token work of the kernels decoder (multiply-adds on the fp32 and int8 dot
        paths, weight bytes, KV bytes per slot: ``profile.decoder_work``), or None."""
        ...


# The ops a C forward clocks (kernels.c's OP_* order): the norms (both of every layer and
# the final one), the q/k/v projection, RoPE and the cache store, attention, the output
# projection, gate and up, SiLU·up, down (each summed over the layers), the output head
KERNEL_OPS = ("norm", "qkv", "rope", "attention", "o", "gate_up", "act", "down", "head")


@runtime_checkable
class ClocksKernelOps(Protocol):
    """A model whose C forward can time its ops (``speculative profile --ops``): where a
    forward's time goes, op by op (``ckernels.KERNEL_OPS``)."""

    def clock_kernel_ops(self, seconds: torch.Tensor | None) -> bool:
        """Have every later forward add each op's wall seconds to ``seconds``
        ([len(KERNEL_OPS)] float64, kept alive by the caller), or stop (None). False when
        this instance does not run on the C kernels (nothing is clocked)."""
        ...
