"""The interface of the two native decoders and what they share: output width, weight
bytes, cache allocation."""

from __future__ import annotations

from typing import Any

import torch

from speculative.models.native.linear import tensor_bytes


def layer_weight_bytes(layer: Any) -> int:
    """Bytes one decode step reads from a packed layer: four linears and two norms."""
    linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
    norms = tensor_bytes(layer.input_norm, layer.post_attention_norm)
    return sum(x.weight_bytes() for x in linears) + norms


class DecoderBase:
    """Layers + final norm + output head + KV cache of a native model; subclassed by
    :class:`TorchDecoder` and :class:`KernelDecoder` (each with its own cache layout)."""

    layers: list[Any]  # per-layer packed weights, each with weight_bytes()
    lm_head: Any  # packed output projection with out_features and weight_bytes()
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kernels: dict[str, str]  # what runs the layers, for reports (e.g. weight shape -> kernel)

    def __init__(self) -> None:
        self.kernels = {}
        self._batch = 0
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def weight_bytes(self) -> int:
        return self.lm_head.weight_bytes() + sum(layer.weight_bytes() for layer in self.layers)

    def allocate(self, batch: int) -> None:
        """(Re)allocate the cache for ``batch`` sequences (only ever called when empty).

        Zero-initialised, so slots never written are finite."""
        if batch == self._batch:
            return
        shape = self.cache_shape(batch)
        self.k_cache = torch.zeros(shape)
        self.v_cache = torch.zeros(shape)
        self._batch = batch

    def cache_shape(self, batch: int) -> tuple[int, ...]:
        raise NotImplementedError

    def copy_cache_from(self, source: DecoderBase, length: int) -> None:
        """Copy slots [0, length) of ``source``'s cache (same layout, batch of one)."""
        raise NotImplementedError

    def keep_slots(self, first: int, slots: list[int]) -> None:
        """Move cache slots ``slots`` (increasing, >= first) to first, first + 1, ..."""
        raise NotImplementedError

    def forward(
        self,
        hidden: torch.Tensor,  # [batch, k, hidden] float32, owned: left holding the final
        # residual stream (the features before the final norm)
        start: int,
        positions: torch.Tensor,  # [batch, k] int64
        attention_mask: torch.Tensor | None,  # [k, k] bool or None (causal)
    ) -> torch.Tensor:  # [batch, k, vocab] float32
        raise NotImplementedError
