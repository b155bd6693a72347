"""The interface of the two native decoders and what they share: output width, weight
bytes, cache allocation."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

import torch

from speculative.models.native.hugepages import zeros_on_huge_pages
from speculative.models.native.layers import LayerWeights
from speculative.models.native.linear import tensor_bytes
from speculative.models.native.loading import Weight
from speculative.sampling.probs import RowProbs

# positions per slot of a new cache; it doubles as sequences grow (DecoderBase.hold_positions)
FIRST_POSITIONS = 512


class _Packed(Protocol):
    def weight_bytes(self) -> int: ...


LinearT = TypeVar("LinearT", bound=_Packed)


@dataclass
class PackedLayer(Generic[LinearT]):
    """One decoder block's weights as a decoder packed them: two norms (and Qwen3's query
    and key norms) and four fused linears of the decoder's own kind (PyTorch ops:
    ``PackedLinear``; the C kernels: ``KernelLinear``)."""

    input_norm: torch.Tensor  # [hidden] float32
    post_attention_norm: torch.Tensor  # [hidden] float32
    qkv: LinearT  # hidden -> q_size + 2 * kv_size
    o: LinearT  # q_size -> hidden
    gate_up: LinearT  # hidden -> 2 * intermediate
    down: LinearT  # intermediate -> hidden
    qk_norm: torch.Tensor | None = None  # [2, head_dim] float32 (LayerWeights.qk_norm)

    @classmethod
    def pack(
        cls, weights: LayerWeights, make_linear: Callable[[Weight, torch.Tensor | None], LinearT]
    ) -> PackedLayer[LinearT]:
        """Pack a block's fused weights with ``make_linear(weight, bias)``."""
        return cls(
            input_norm=weights.input_norm.float().contiguous(),
            post_attention_norm=weights.post_attention_norm.float().contiguous(),
            qkv=make_linear(weights.qkv, weights.qkv_bias),
            o=make_linear(weights.o, None),
            gate_up=make_linear(weights.gate_up, None),
            down=make_linear(weights.down, None),
            qk_norm=None if weights.qk_norm is None else weights.qk_norm.float().contiguous(),
        )

    def weight_bytes(self) -> int:
        """Bytes one decode step reads from the block: four linears and its norms."""
        linears = (self.qkv, self.o, self.gate_up, self.down)
        norms = tensor_bytes(self.input_norm, self.post_attention_norm, self.qk_norm)
        return sum(x.weight_bytes() for x in linears) + norms


@dataclass(frozen=True)
class Segment:
    """One sequence's new tokens in a ragged forward: appended to cache slot ``slot`` at
    cache positions ``start`` .. ``start + rows - 1``."""

    slot: int
    start: int
    rows: int
    positions: torch.Tensor | None  # [rows] int64 RoPE positions; None: the cache positions
    mask: torch.Tensor | None  # [rows, rows] bool (True = may attend) or None (causal)
    logits_from: int = 0  # its first row whose logits are wanted (RowInput.logits_from)

    @property
    def logit_rows(self) -> int:
        """Rows whose logits the forward returns."""
        return self.rows - self.logits_from

    def rope_positions(self) -> torch.Tensor:  # [rows] int64
        """The RoPE positions as a tensor (the cache positions where none were given)."""
        if self.positions is None:
            return torch.arange(self.start, self.start + self.rows)
        return self.positions

    def position_list(self) -> list[int]:
        """The RoPE positions as Python ints (no tensor op in the default case)."""
        if self.positions is None:
            return list(range(self.start, self.start + self.rows))
        return self.positions.tolist()


class DecoderBase:
    """Layers + final norm + output head + KV cache of a native model; subclassed by
    :class:`TorchDecoder` and :class:`KernelDecoder` (each with its own cache layout)."""

    layers: list[Any]  # per-layer packed weights, each with weight_bytes()
    lm_head: Any  # packed output projection with out_features and weight_bytes()
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kernels: dict[str, str]  # what runs the layers, for reports (e.g. weight shape -> kernel)
    library: object | None = None  # the C kernel library running the layers, if any
    kv_dtype: torch.dtype = torch.float32  # the cache's elements: float32 or float16

    def __init__(self) -> None:
        self.kernels = {}
        self._batch = 0
        self._positions = 0  # positions each cache slot holds now (grown on use)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def weight_bytes(self) -> int:
        return self.lm_head.weight_bytes() + sum(layer.weight_bytes() for layer in self.layers)

    slot_dim: int  # the cache slot (sequence) dimension of k_cache / v_cache
    config: Any  # the NativeConfig of the layers this decoder runs
    max_positions: int  # the most positions a cache slot may grow to (the context window)

    def truncated(self, num_layers: int) -> DecoderBase:
        """A decoder over the SAME packed weights that runs only the first ``num_layers``
        layers, then the final norm and the output head (early exit), with its own empty
        cache: the weights are shared, not copied."""
        if not 1 <= num_layers <= len(self.layers):
            total = len(self.layers)
            raise ValueError(f"early exit needs 1 <= layers <= {total}, got {num_layers}")
        clone = copy.copy(self)
        clone.config = replace(self.config, num_layers=num_layers)
        clone.layers = self.layers[:num_layers]
        clone.kernels = dict(self.kernels)
        clone._batch = clone._positions = 0
        clone.k_cache, clone.v_cache = torch.empty(0), torch.empty(0)
        clone._rebuild()
        return clone

    def _rebuild(self) -> None:
        """Refresh what a decoder derives from its layer list (after :meth:`truncated`)."""

    def allocate(self, batch: int, positions: int | None = None) -> None:
        """(Re)allocate the cache for ``batch`` sequences of ``positions`` positions each
        (None: as many as now, or :data:`FIRST_POSITIONS` for a new cache); what the
        existing slots hold is kept where it fits, growing or shrinking.

        Zero-initialised, so slots never written are finite."""
        if positions is None:
            positions = self._positions or min(FIRST_POSITIONS, self.max_positions)
        if (batch, positions) == (self._batch, self._positions):
            return
        shape = self.cache_shape(batch, positions)
        k_cache = zeros_on_huge_pages(shape, self.kv_dtype)
        v_cache = zeros_on_huge_pages(shape, self.kv_dtype)
        if self._batch and self._positions:
            old = self.k_cache.shape
            kept = tuple(slice(0, min(a, b)) for a, b in zip(shape, old, strict=True))
            k_cache[kept] = self.k_cache[kept]
            v_cache[kept] = self.v_cache[kept]
        self.k_cache, self.v_cache = k_cache, v_cache
        self._batch, self._positions = batch, positions
        self._cache_resized()

    def hold_positions(self, end: int) -> None:
        """Have every cache slot hold positions [0, ``end``): a slot's memory follows the
        longest sequence so far, not the context window. The cache grows to twice its
        positions (at most ``max_positions``), since each growth copies it whole."""
        if end > self._positions:
            grown = min(self.max_positions, max(end, 2 * self._positions))
            self.allocate(self._batch, grown)

    def _cache_resized(self) -> None:
        """Refresh what a decoder derives from its cache's shape (after :meth:`allocate`)."""

    def cache_shape(self, batch: int, positions: int) -> tuple[int, ...]:
        raise NotImplementedError

    def copy_cache_from(
        self,
        source: DecoderBase,
        length: int,
        source_slot: int = 0,
        target_slot: int = 0,
        start: int = 0,
    ) -> None:
        """Copy positions [start, length) of ``source``'s sequence ``source_slot`` (same
        layout; ``source`` may be this decoder, or one with more layers, whose first ones
        are copied) into this one's ``target_slot``."""
        raise NotImplementedError

    def runs_first_layers_of(self, other: DecoderBase) -> bool:
        """Whether this decoder's layers are ``other``'s first layers, the very same
        packed weights (an early exit of ``other``, :meth:`truncated`): its keys and values
        for a sequence are then ``other``'s for those layers."""
        mine, theirs = self.layers, other.layers
        return len(mine) <= len(theirs) and all(
            a is b for a, b in zip(mine, theirs[: len(mine)], strict=True)
        )

    def keep_slots(self, first: int, slots: list[int], cache_slot: int | None = None) -> None:
        """Move cache slots ``slots`` (increasing, >= first) to first, first + 1, ... of
        sequence ``cache_slot`` (every sequence when None)."""
        raise NotImplementedError

    def forward(
        self,
        hidden: torch.Tensor,  # [batch, k, hidden] float32, owned: left holding the
        # features (the final residual stream after the final norm)
        start: int,
        positions: torch.Tensor | None,  # [batch, k] int64; None: the cache positions
        attention_mask: torch.Tensor | None,  # [k, k] bool or None (causal)
        logits_from: int = 0,  # the first token whose logits are wanted
    ) -> torch.Tensor:  # [batch, k - logits_from, vocab] float32
        """Row b of the batch appends to cache slot b at ``start``: one ragged forward."""
        batch, k, width = hidden.shape
        rope = [None] * batch if positions is None else list(positions)  # [k] each
        segments = [
            Segment(b, start, k, rope[b], attention_mask, logits_from) for b in range(batch)
        ]
        logits = self.forward_segments(hidden.view(batch * k, width), segments)
        return logits.view(batch, k - logits_from, -1)

    def argmax_rows(self, logits: torch.Tensor) -> list[int] | None:
        """Each row's argmax as the last forward computed it, when ``logits`` are rows of
        that forward's output; None when this decoder does not compute it."""
        return None

    def nucleus(self, logits: torch.Tensor, temperature: float, top_p: float) -> RowProbs | None:
        """A logits row's top-p distribution found by compiled code, or None: this decoder
        has none (the sampling layer finds it)."""
        return None

    def copy_layers_into(self, layers: Sequence[int], out: torch.Tensor | None) -> None:
        """Have later forwards copy the residual stream after each of ``layers`` (0-based,
        increasing) into ``out`` ([len(layers), rows, hidden] float32, the forward's rows in
        order), or stop (None)."""
        raise NotImplementedError

    def clock_ops(self, seconds: torch.Tensor | None) -> bool:
        """Clock every later forward's ops into ``seconds`` (``models.base.KERNEL_OPS``),
        or stop (None); False: this decoder has no op clock."""
        return False

    def forward_segments(
        self,
        hidden: torch.Tensor,  # [rows, hidden] float32, owned: left holding the features
        # (as in forward); segment i owns the next segments[i].rows rows
        segments: Sequence[Segment],
    ) -> torch.Tensor:  # [sum of logit_rows, vocab] float32
        """Append several sequences' new tokens, each to its own cache slot, in one call;
        returns the logits of each segment's rows from its ``logits_from`` on, in order; a
        segment's logits equal (bitwise) those of a call with that segment alone."""
        raise NotImplementedError
