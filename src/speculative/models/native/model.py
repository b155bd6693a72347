"""A compact Llama-architecture decoder with a position-indexed KV cache.

Covers Llama / SmolLM2 / Mistral (whose sliding window bounds the context: attention
over a context that fits the window is the window's), Qwen2 (q/k/v biases) and Qwen3
(per-head q/k RMSNorm, head_dim apart from hidden / heads): RMSNorm, RoPE (with Llama 3's
scaling, from a config or a GGUF's rope_freqs), grouped-query attention, SwiGLU, tied or
untied embeddings.

Two decoders run the layers behind one interface: ``"kernels"`` (:mod:`.ckernels`, one
C function per forward: AVX2 + OpenMP, weights streamed once for all k tokens) and
``"torch"`` (:mod:`.torch_decoder`, PyTorch ops; the fallback when no C compiler is
available, and the reference the kernels are tested against). ``backend="auto"`` picks
the kernels when they build.

Cache slots are filled in call order (slot = cache_length + j for the j-th new token);
the cache holds as many positions per sequence as the longest one so far needs, doubling
up to the context window (``max_length``), so a long window costs memory only when used.
RoPE positions are a separate input, so a token tree can be verified in one call by
passing its depth-based ``position_ids`` and an ancestor ``attention_mask``.

k-invariance (both decoders): the logits of a token do not depend on how many tokens
share its forward (a block of k for speculative verification or one decode step at a
time); block and step forwards agree bitwise. Speculative sampling is lossless only
because of this.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import torch

from speculative.models.base import (
    RowInput,
    check_feature_layers,
    check_keep_slots,
    check_logits_from,
)
from speculative.models.native.config import NativeConfig, context_window, rope_inverse_frequencies
from speculative.models.native.decoder_base import DecoderBase, Segment
from speculative.models.native.layers import layer_weights
from speculative.models.native.linear import PRECISIONS
from speculative.models.native.loading import Checkpoint, Weight
from speculative.models.precision import traits
from speculative.sampling.probs import RowProbs

BACKENDS = ("auto", "kernels", "torch")
KV_CACHES = ("auto", "fp32", "fp16")
KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def resolved_kv_cache(precision: str, kv_cache: str = "auto") -> str:
    """The KV cache's element type, "fp32" or "fp16" (IEEE half: each key and value
    rounded once, to nearest even, when stored; attention reads it back exactly); "auto":
    fp32 for an fp32 model, half for the precisions that already round their weights
    (bf16, int8, int4), as llama.cpp does. Attention streams a sequence's whole cache
    every step, a large share of a decode step at long contexts and in large batches."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"unknown KV cache type {kv_cache!r}; expected one of {KV_CACHES}")
    if kv_cache == "auto":
        return traits(precision).kv_cache
    return kv_cache


def build_decoder(
    checkpoint: Checkpoint,
    precision: str,
    rotations: torch.Tensor,
    backend: str,
    kv_dtype: torch.dtype = torch.float32,
) -> tuple[DecoderBase, str]:
    """The decoder for ``backend`` ("auto" tries the kernels, then torch) and its name.

    rotations: [max_length, head_dim / 2] complex64; kv_dtype: the cache's element type
    (float32 or float16).
    """
    from speculative.models.native.ckernels import KernelDecoder, KernelsUnavailable, load_kernels
    from speculative.models.native.torch_decoder import TorchDecoder

    cfg = checkpoint.config
    layers = [layer_weights(checkpoint, i) for i in range(cfg.num_layers)]
    final_norm = checkpoint.dense("model.norm.weight")  # [hidden]
    head_key = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head: Weight = checkpoint.tensors[head_key]
    if backend in ("auto", "kernels"):
        try:
            library = load_kernels()
            decoder = KernelDecoder(
                cfg, layers, final_norm, head, rotations, precision, library, kv_dtype
            )
            return decoder, "kernels"
        except KernelsUnavailable as error:
            if backend == "kernels":
                raise
            warnings.warn(
                f"native C kernels unavailable ({error}); using the slower PyTorch decoder",
                RuntimeWarning,
                stacklevel=3,
            )
    decoder = TorchDecoder(cfg, layers, final_norm, head, rotations, precision, kv_dtype=kv_dtype)
    return decoder, "torch"


class NativeLlama:
    """Llama-family causal LM implementing :class:`speculative.models.base.CausalLM`."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        precision: str = "fp32",
        max_length: int | None = None,
        backend: str = "auto",
        max_slots: int = 64,
        kv_cache: str = "auto",
    ):
        """max_length: the context window in tokens (None: the model's own, see
        :func:`~speculative.models.native.config.context_window`); the cache holds what
        the sequences use, growing up to it. max_slots: most sequences the cache may hold
        at once (batched decoding); kv_cache: the cache's element type (see
        :func:`resolved_kv_cache`)."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        self.kv_cache = resolved_kv_cache(precision, kv_cache)  # "fp32" or "fp16"
        cfg = checkpoint.config
        max_length = context_window(cfg, max_length)
        self.config: NativeConfig = cfg
        self.precision = precision
        self._max_length = max_length
        self.embed = checkpoint.dense("model.embed_tokens.weight")  # [vocab, hidden]
        inv_freq = rope_inverse_frequencies(cfg)  # [head_dim // 2]
        angles = torch.outer(torch.arange(max_length, dtype=torch.float32), inv_freq)
        rotations = torch.polar(torch.ones_like(angles), angles)  # [max_length, d/2]
        self.decoder, self.backend = build_decoder(
            checkpoint, precision, rotations, backend, KV_DTYPES[self.kv_cache]
        )
        tied = cfg.tie_word_embeddings
        self._head_weight = None if tied else checkpoint.dense("lm_head.weight")  # [vocab, H]
        self.name = f"{checkpoint.name}-native-{precision}"
        self._length = 0  # the single-sequence (``forward``) batch: slots [0, _batch)
        self._batch = 0
        self._max_slots = max_slots
        self._slot_lengths: dict[int, int] = {}  # acquired slots (``forward_rows``)
        self._holders: dict[int, int] = {}  # slot -> its acquisition (SharesSlotPrefix.holder)
        self._acquisitions = 0  # acquisitions so far: each one's number
        # released (or re-acquired, not yet written) slots: (positions still holding the
        # keys and values of an acquisition, that acquisition) (SharesSlotPrefix.retained)
        self._retained: dict[int, tuple[int, int]] = {}
        self._releases = 0  # releases so far: a released slot's number orders eviction
        self._released_at: dict[int, int] = {}  # slot -> the release that freed it last
        self._feature_layers: tuple[int, ...] = ()  # SupportsLayerFeatures

    # ---- protocol -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @property
    def max_length(self) -> int:
        return self._max_length

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (packed linears and norms; the
        embedding rows it gathers are excluded)."""
        return self.decoder.weight_bytes()

    @property
    def cache_length(self) -> int:
        return self._length

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot roll back {n} of {self._length} cached positions")
        self._length -= n

    def reset(self) -> None:
        self._length = 0

    def import_cache(
        self,
        source: object,
        length: int,
        source_slot: int | None = None,
        slot: int | None = None,
        start: int = 0,
    ) -> bool:
        """Copy ``source``'s cached positions [start, length) into this cache, when
        ``source`` is a NativeLlama of the same shape and decoder layout, or the model this
        one is an early exit of (its first layers' keys and values are then this model's
        own, bitwise): from its single-sequence cache, or from its cache slot
        ``source_slot``; into this model's single-sequence cache (a batch of one), or into
        its cache slot ``slot``, whose positions before ``start`` are kept."""
        if not isinstance(source, NativeLlama) or length < 1:
            return False
        if source_slot is None:
            held, source_slot = (source.cache_length if source._batch == 1 else 0), 0
        else:
            held = source._slot_lengths.get(source_slot, 0)
        layers_match = (
            source.config.num_layers == self.config.num_layers
            or self.decoder.runs_first_layers_of(source.decoder)
        )
        same_shape = (
            layers_match
            and source.config.num_kv_heads == self.config.num_kv_heads
            and source.config.head_dim == self.config.head_dim
            and source.max_length == self.max_length
            and source.backend == self.backend
        )
        if not same_shape or length > held or not 0 <= start < length:
            return False
        if slot is None:
            if start and (self._batch != 1 or start > self.cache_length):
                return False
            if not start:
                self.reset()
                self._ensure_cache(1)
            self.decoder.copy_cache_from(source.decoder, length, source_slot, 0, start)
            self._length = length
            return True
        self._check_slot(slot)
        if start > self._slot_lengths[slot]:
            return False
        self.decoder.copy_cache_from(source.decoder, length, source_slot, slot, start)
        self._retained.pop(slot, None)
        self._slot_lengths[slot] = length
        return True

    # ---- early exit (SupportsEarlyExit) ---------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def early_exit(self, num_layers: int) -> NativeLlama:
        """A model over the SAME packed weights that runs only the first ``num_layers``
        layers, then the final norm and the output head; its own empty cache."""
        total = self.config.num_layers
        if not 1 <= num_layers <= total:
            raise ValueError(f"early_exit needs 1 <= num_layers <= {total}, got {num_layers}")
        clone = copy.copy(self)
        clone.decoder = self.decoder.truncated(num_layers)
        clone.config = clone.decoder.config
        clone.name = f"{self.name}[:{num_layers}/{total} layers]"
        clone._length, clone._batch = 0, 0
        clone._slot_lengths, clone._retained, clone._holders = {}, {}, {}
        clone._released_at, clone._releases = {}, 0
        return clone

    # ---- batch rows (SupportsBatchRows) ---------------------------------------------
    def acquire_slot(self) -> int:
        """A free cache slot (not held by ``forward``'s batch nor another owner): the
        lowest allocated one that retains nothing, else the one released longest ago
        (what it retains is the least recently used), else a new one (the cache grows)."""
        free = self._free_slots()
        if not free:
            raise ValueError(f"no free cache slot: all {self._max_slots} are in use")
        allocated = [s for s in free if s < self.decoder._batch]
        empty = [s for s in allocated if self._retained.get(s, (0, 0))[0] == 0]
        if empty:
            return self._take(empty[0])
        if allocated:
            return self._take(min(allocated, key=lambda s: self._released_at.get(s, 0)))
        return self._take(free[0])

    def reacquire_slot(self, slot: int) -> None:
        """See :class:`~speculative.models.base.SharesSlotPrefix`."""
        if slot not in self._free_slots():
            raise ValueError(f"cache slot {slot} is not free")
        self._take(slot)

    def _free_slots(self) -> list[int]:
        """Slots neither acquired nor held by ``forward``'s batch, lowest first."""
        held = range(self._batch) if self._length else range(0)
        return [s for s in range(self._max_slots) if s not in self._slot_lengths and s not in held]

    def _take(self, slot: int) -> int:
        """Acquire the free ``slot`` (growing the cache to hold it)."""
        self._grow(slot + 1)
        self._slot_lengths[slot] = 0
        self._acquisitions += 1
        self._holders[slot] = self._acquisitions
        return slot

    def copy_slot_prefix(self, source: int, target: int, length: int) -> None:
        """See :class:`~speculative.models.base.SharesSlotPrefix`."""
        if self.slot_length(target) != 0:
            raise ValueError(f"slot {target} must be empty")
        live = source in self._slot_lengths and source != target
        held = self._slot_lengths[source] if live else self._retained.get(source, (0, 0))[0]
        if not 0 < length <= held:
            raise ValueError(f"slot {source} holds {held} positions, not {length}")
        if source != target:  # a slot's own leftovers need no copy
            self.decoder.copy_cache_from(self.decoder, length, source, target)
        self._retained.pop(target, None)
        self._slot_lengths[target] = length

    def holder(self, slot: int) -> int:
        """See :class:`~speculative.models.base.SharesSlotPrefix`."""
        return self._holders.get(slot, 0)

    def retained(self, slot: int, holder: int) -> int:
        """See :class:`~speculative.models.base.SharesSlotPrefix`."""
        length, left_by = self._retained.get(slot, (0, 0))
        return length if left_by == holder else 0

    def release_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self._retained[slot] = (self._slot_lengths.pop(slot), self._holders[slot])
        self._releases += 1
        self._released_at[slot] = self._releases

    def slot_length(self, slot: int) -> int:
        self._check_slot(slot)
        return self._slot_lengths[slot]

    def rollback_slot(self, slot: int, n: int) -> None:
        length = self.slot_length(slot)
        if not 0 <= n <= length:
            raise ValueError(f"cannot roll back {n} of {length} positions of slot {slot}")
        self._slot_lengths[slot] = length - n

    def keep_slot_positions(self, slot: int, first: int, positions: Sequence[int]) -> None:
        """Keep positions [0, first) of ``slot`` and move ``positions`` right after them."""
        kept = check_keep_slots(first, positions, self.slot_length(slot))
        if kept != list(range(first, first + len(kept))):
            self.decoder.keep_slots(first, kept, cache_slot=slot)
        self._slot_lengths[slot] = first + len(kept)

    @torch.no_grad()
    def forward_rows(self, rows: Sequence[RowInput]) -> list[torch.Tensor]:
        """Every row's new tokens through one forward (one weight pass on the kernels);
        returns [k_row, vocab] float32 logits per row, bitwise those of the row alone."""
        logits, _ = self._forward_rows(rows, features=False)
        return logits

    def forward_rows_with_hidden(
        self, rows: Sequence[RowInput]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """As :meth:`forward_rows`, with the pass's features [Σ k_row, hidden] (the final
        residual stream after the final norm, as :meth:`forward_with_hidden`), rows in
        order."""
        return self._forward_rows(rows, features=True)

    def _forward_rows(
        self, rows: Sequence[RowInput], features: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per-row logits and the features [total, hidden] of the pass (with the feature
        layers' states only when ``features``: a pass without them copies none out)."""
        if not rows:
            return [], torch.empty(0, self.config.hidden_size * (1 + len(self._feature_layers)))
        segments = [self._segment(row) for row in rows]
        if len({row.slot for row in rows}) != len(rows):
            raise ValueError("a slot appears twice in one forward_rows call")
        ids = rows[0].input_ids if len(rows) == 1 else torch.cat([row.input_ids for row in rows])
        # [total, hidden], a copy the decoder updates in place
        hidden = torch.index_select(self.embed, 0, ids)
        layers = self._capture_layers(hidden.shape[0]) if features else None
        try:
            logits = self.decoder.forward_segments(hidden, segments)  # [wanted, vocab]
        finally:
            self._stop_capture(layers)
        for segment in segments:
            self._slot_lengths[segment.slot] = segment.start + segment.rows
            self._retained.pop(segment.slot, None)  # written: the last owner's data is gone
        return _split(logits, [segment.logit_rows for segment in segments]), _widen(hidden, layers)

    def _segment(self, row: RowInput) -> Segment:
        start = self.slot_length(row.slot)
        k = row.input_ids.numel()
        if row.input_ids.dim() != 1 or k == 0:
            shape = tuple(row.input_ids.shape)
            raise ValueError(f"row input_ids must be [k] with k >= 1, got {shape}")
        if start + k > self._max_length:
            raise ValueError(
                f"cache overflow in slot {row.slot}: {start} cached + {k} new > "
                f"max_length {self._max_length}"
            )
        if row.attention_mask is not None and row.attention_mask.shape != (k, k):
            shape = tuple(row.attention_mask.shape)
            raise ValueError(f"attention_mask must be [{k}, {k}], got {shape}")
        check_logits_from(row.logits_from, k)
        positions = self._positions(row.position_ids, 1, k, start)  # [1, k] or None
        return Segment(row.slot, start, k, None if positions is None else positions[0],
                       row.attention_mask, row.logits_from)  # fmt: skip

    def _check_slot(self, slot: int) -> None:
        if slot not in self._slot_lengths:
            raise ValueError(f"cache slot {slot} is not acquired")

    def reserve_slots(self, count: int) -> None:
        """:class:`ReservesSlots`: the cache holds ``count`` slots (at most ``max_slots``)
        from now on, in one allocation (its pages are touched only when rows write them)."""
        count = min(count, self._max_slots)
        if count > self.decoder._batch:
            self.decoder.allocate(count)

    def _grow(self, slots: int) -> None:
        """Make the cache hold at least ``slots`` sequences (existing slots kept). It grows
        to twice its size (at most ``max_slots``) rather than one slot at a time: each
        growth allocates, zeroes and copies the whole cache, so rows joining one by one
        would copy it O(B²) times."""
        held = self.decoder._batch
        if slots > held:
            self.decoder.allocate(max(slots, min(2 * held, self._max_slots)))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, k] int64
        attention_mask: torch.Tensor | None = None,  # [k, k] bool, True = may attend
        position_ids: torch.Tensor | None = None,  # [k] or [batch, k] int64
    ) -> torch.Tensor:
        """Append ``input_ids`` to the cache; returns [batch, k, vocab] float32 logits.

        Without ``attention_mask`` the new tokens are causal among themselves; with it,
        new token i sees new token j iff ``attention_mask[i, j]`` (and always the cache).
        ``position_ids`` default to ``cache_length + arange(k)``.
        """
        return self.forward_from(input_ids, 0, attention_mask, position_ids)[0]

    __call__ = forward

    def argmax_rows(self, logits: torch.Tensor) -> list[int] | None:
        """See :class:`~speculative.models.base.SupportsFusedArgmax` (the C kernels)."""
        return self.decoder.argmax_rows(logits)

    def nucleus(self, logits: torch.Tensor, temperature: float, top_p: float) -> RowProbs | None:
        """See :class:`~speculative.models.base.SupportsNucleusSearch` (the C kernels)."""
        return self.decoder.nucleus(logits, temperature, top_p)

    def forward_tree(
        self,
        input_ids: torch.Tensor,  # [1, k] int64
        attention_mask: torch.Tensor,  # [k, k] bool
        position_ids: torch.Tensor,  # [k] int64
    ) -> torch.Tensor:
        """A token tree in one forward (see :class:`SupportsTreeAttention`)."""
        return self.forward(input_ids, attention_mask, position_ids)

    def keep_slots(self, first: int, slots: Sequence[int]) -> None:
        """Keep slots [0, first) and move ``slots`` right after them (tree compaction)."""
        kept = check_keep_slots(first, slots, self._length)
        if kept != list(range(first, first + len(kept))):
            for sequence in range(self._batch):  # only ``forward``'s; other slots are rows'
                self.decoder.keep_slots(first, kept, cache_slot=sequence)
        self._length = first + len(kept)

    # ---- features (SupportsHiddenStates) --------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @torch.no_grad()
    def forward_with_hidden(
        self,
        input_ids: torch.Tensor,  # [batch, k] int64
        attention_mask: torch.Tensor | None = None,  # [k, k] bool (a tree), None = causal
        position_ids: torch.Tensor | None = None,  # [k] or [batch, k] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`forward`; also returns [batch, k, hidden] features: both decoders
        leave the features in the buffer they were given (the final norm applied in
        place), so they cost nothing more."""
        logits, features = self.forward_from(input_ids, 0, attention_mask, position_ids, True)
        assert features is not None
        return logits, features

    @torch.no_grad()
    def forward_from(
        self,
        input_ids: torch.Tensor,  # [batch, k] int64
        logits_from: int,
        attention_mask: torch.Tensor | None = None,  # [k, k] bool (a tree), None: causal
        position_ids: torch.Tensor | None = None,  # [k] int64
        hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See :class:`~speculative.models.base.SkipsOutputHead` (any batch here: row b
        appends to the single-sequence cache's slot b): the output head runs only over the
        tokens from ``logits_from`` on; [batch, k - logits_from, vocab] logits."""
        batch, k = self._check_input(input_ids, attention_mask)
        check_logits_from(logits_from, k)
        start = self._length
        self._ensure_cache(batch)
        positions = self._positions(position_ids, batch, k, start)  # [batch, k] or None
        # [batch, k, hidden], a copy the decoder updates in place
        states = torch.index_select(self.embed, 0, input_ids.reshape(-1)).view(batch, k, -1)
        layers = self._capture_layers(batch * k) if hidden else None
        try:
            logits = self.decoder.forward(states, start, positions, attention_mask, logits_from)
        finally:
            self._stop_capture(layers)
        self._length = start + k
        if not hidden:
            return logits, None
        return logits, _widen(states.view(batch * k, -1), layers).view(batch, k, -1)

    # ---- middle-layer features (SupportsLayerFeatures; num_layers above) -------------
    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self._feature_layers

    def set_feature_layers(self, layers: Sequence[int]) -> None:
        """See :class:`~speculative.models.base.SupportsLayerFeatures`."""
        self._feature_layers = check_feature_layers(layers, self.config.num_layers)

    def _capture_layers(self, rows: int) -> torch.Tensor | None:
        """Have the next forward copy the feature layers' states of its ``rows`` rows into
        a new [layers, rows, hidden] tensor (returned), or None without feature layers."""
        if not self._feature_layers:
            return None
        out = torch.empty(len(self._feature_layers), rows, self.config.hidden_size)
        self.decoder.copy_layers_into(self._feature_layers, out)
        return out

    def _stop_capture(self, layers: torch.Tensor | None) -> None:
        if layers is not None:
            self.decoder.copy_layers_into((), None)

    def input_embedding(self) -> torch.Tensor:
        return self.embed  # [vocab, hidden]

    # ---- kernels (SupportsKernels) --------------------------------------------------
    def kernel_library(self) -> object | None:
        """The C kernel library running the layers (None on the PyTorch decoder)."""
        return self.decoder.library

    def kernel_work(self) -> dict[str, int] | None:
        if self.kernel_library() is None:
            return None
        from speculative.models.native.profile import decoder_work

        return decoder_work(self.decoder)

    def clock_kernel_ops(self, seconds: torch.Tensor | None) -> bool:
        """:class:`ClocksKernelOps`: the kernels decoder's op clock (False on PyTorch)."""
        return self.decoder.clock_ops(seconds)

    def output_embedding(self) -> torch.Tensor:
        return self.embed if self._head_weight is None else self._head_weight

    # ---- internals ------------------------------------------------------------------
    def _check_input(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[int, int]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, k], got shape {tuple(input_ids.shape)}")
        batch, k = input_ids.shape
        if k == 0:
            raise ValueError("input_ids must hold at least one token")
        if self._length + k > self._max_length:
            raise ValueError(
                f"cache overflow: {self._length} cached + {k} new > max_length {self._max_length}"
            )
        if attention_mask is not None and attention_mask.shape != (k, k):
            raise ValueError(
                f"attention_mask must be [k, k] = [{k}, {k}], got {tuple(attention_mask.shape)}"
            )
        return batch, k

    def _ensure_cache(self, batch: int) -> None:
        taken = sorted(s for s in self._slot_lengths if s < batch)
        if taken:
            raise ValueError(f"cache slot {taken[0]} is held by a batch row (forward_rows)")
        self._retained.clear()  # the single sequence writes slots [0, batch)
        if batch == self._batch:
            return
        if self._length:
            raise ValueError(f"batch changed from {self._batch} to {batch} with a non-empty cache")
        self._grow(batch)
        self._batch = batch

    def _positions(
        self, position_ids: torch.Tensor | None, batch: int, k: int, start: int
    ) -> torch.Tensor | None:
        """[batch, k] int64 RoPE positions, None for the cache positions (the default:
        the decoders then need no tensor for them)."""
        if position_ids is None:
            return None
        positions = position_ids.long().reshape(-1, k).expand(batch, k)  # [batch, k]
        if positions.min() < 0 or positions.max() >= self._max_length:
            raise ValueError(f"position_ids must lie in [0, {self._max_length})")
        return positions


def _widen(features: torch.Tensor, layers: torch.Tensor | None) -> torch.Tensor:
    """[rows, H] features and [n, rows, H] layer states -> [rows, H * (1 + n)] (the
    features alone without layers)."""
    if layers is None:
        return features
    rows = features.shape[0]
    return torch.cat([features, layers.transpose(0, 1).reshape(rows, -1)], dim=1)


def _split(rows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``rows.split(sizes)`` as a list; one part is ``rows`` itself, without the call (right
    after a forward every torch call costs tens of microseconds on cold caches)."""
    return [rows] if len(sizes) == 1 else list(rows.split(sizes))
