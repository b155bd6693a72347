"""What the two native decoders share: output width, weight bytes, cache allocation."""

from __future__ import annotations

from typing import Any

import torch


class DecoderBase:
    """Base of :class:`TorchDecoder` and :class:`KernelDecoder` (each its own cache layout)."""

    layers: list[Any]  # per-layer packed weights, each with weight_bytes()
    lm_head: Any  # packed output projection with out_features and weight_bytes()
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self) -> None:
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
