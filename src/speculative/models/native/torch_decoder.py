"""The PyTorch decoder of the native runtime: the portable fallback and the reference.

Runs anywhere PyTorch runs (no C compiler needed); :mod:`.ckernels` is the fast path.
Linear layers are pre-packed for MKL / oneDNN (see :mod:`.linear`).

k-invariance: every op works row by row with kernels whose per-row result does not
depend on the row count, and attention reduces over keys in fixed chunks of
``KEY_CHUNK`` cache slots (masked slots contribute exact zeros), so block and step
forwards agree bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculative.models.native.config import NativeConfig
from speculative.models.native.decoder_base import DecoderBase, layer_weight_bytes
from speculative.models.native.layers import LayerWeights, lm_head_precision
from speculative.models.native.linear import PackedLinear, make_linear
from speculative.models.native.loading import Weight

KEY_CHUNK = 128  # cache slots per attention chunk; attention reads whole chunks


@dataclass
class TorchLayer:
    """One decoder block's packed weights."""

    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    qkv: PackedLinear  # hidden -> q_size + 2 * kv_size
    o: PackedLinear  # q_size -> hidden
    gate_up: PackedLinear  # hidden -> 2 * intermediate
    down: PackedLinear  # intermediate -> hidden

    @classmethod
    def pack(cls, weights: LayerWeights, precision: str) -> TorchLayer:
        return cls(
            input_norm=weights.input_norm,
            post_attention_norm=weights.post_attention_norm,
            qkv=make_linear(weights.qkv, weights.qkv_bias, precision),
            o=make_linear(weights.o, None, precision),
            gate_up=make_linear(weights.gate_up, None, precision),
            down=make_linear(weights.down, None, precision),
        )

    def weight_bytes(self) -> int:
        return layer_weight_bytes(self)


def _cache_segments(start: int, k: int) -> list[tuple[int, int, int, int]]:
    """Cache slots start .. start + k - 1 split by chunk: (chunk, first, last, token).

    Chunk ``chunk`` receives offsets [first, last) from new tokens token, token + 1, ...
    """
    segments = []
    slot = start
    while slot < start + k:
        chunk, first = divmod(slot, KEY_CHUNK)
        last = min(KEY_CHUNK, first + start + k - slot)
        segments.append((chunk, first, last, slot - start))
        slot += last - first
    return segments


class TorchDecoder(DecoderBase):
    """Decoder layers, final norm, output head and KV cache, in PyTorch ops."""

    def __init__(
        self,
        config: NativeConfig,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,  # [hidden]
        head: Weight,  # [vocab, hidden]
        rotations: torch.Tensor,  # [max_length, head_dim / 2] complex64
        precision: str,
    ) -> None:
        super().__init__()
        self.config = config
        self.layers = [TorchLayer.pack(w, precision) for w in layers]
        self.final_norm = final_norm
        self.lm_head = make_linear(head, None, lm_head_precision(precision))
        self.rotations = rotations
        self._chunks = -(-rotations.shape[0] // KEY_CHUNK)

    def cache_shape(self, batch: int) -> tuple[int, ...]:
        """[layers, batch, chunks, kv_heads, KEY_CHUNK, head_dim]: slot s lives in chunk
        s // KEY_CHUNK at offset s % KEY_CHUNK."""
        cfg = self.config
        return (cfg.num_layers, batch, self._chunks, cfg.num_kv_heads, KEY_CHUNK, cfg.head_dim)

    def copy_cache_from(self, source: TorchDecoder, length: int) -> None:
        """Copy slots [0, length) of ``source``'s cache (same layout, batch of one)."""
        for first in range(0, length, KEY_CHUNK):
            chunk, last = first // KEY_CHUNK, min(KEY_CHUNK, length - first)
            self.k_cache[:, :, chunk, :, :last] = source.k_cache[:, :, chunk, :, :last]
            self.v_cache[:, :, chunk, :, :last] = source.v_cache[:, :, chunk, :, :last]

    def keep_slots(self, first: int, slots: list[int]) -> None:
        """Move cache slots ``slots`` (increasing, >= first) to first, first + 1, ...
        (in order: a destination never lies after a source still to be read)."""
        for target, source in enumerate(slots, start=first):
            (tc, to), (sc, so) = divmod(target, KEY_CHUNK), divmod(source, KEY_CHUNK)
            self.k_cache[:, :, tc, :, to] = self.k_cache[:, :, sc, :, so]
            self.v_cache[:, :, tc, :, to] = self.v_cache[:, :, sc, :, so]

    def forward(
        self,
        hidden: torch.Tensor,  # [batch, k, hidden] float32 embeddings, owned (updated in place)
        start: int,
        positions: torch.Tensor,  # [batch, k] int64
        attention_mask: torch.Tensor | None,  # [k, k] bool or None (causal)
    ) -> torch.Tensor:  # [batch, k, vocab]
        batch, k, _ = hidden.shape
        rotation = self.rotations[positions].unsqueeze(2)  # [batch, k, 1, head_dim / 2]
        blocked = ~self._visibility(attention_mask, k, start)  # [k, chunks * KEY_CHUNK]
        slots = _cache_segments(start, k)
        hidden = hidden.reshape(batch * k, -1)  # the residual stream, updated in place
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, batch, k, slots, rotation, blocked)
        eps = self.config.rms_norm_eps
        hidden = F.rms_norm(hidden, hidden.shape[-1:], self.final_norm, eps)
        return self.lm_head(hidden).reshape(batch, k, -1)

    def _visibility(self, attention_mask: torch.Tensor | None, k: int, start: int) -> torch.Tensor:
        """Which cache slots each new token sees: [k, chunks * KEY_CHUNK] bool.

        Covers whole chunks up to the last new slot; slots past it are never visible.
        """
        width = -(-(start + k) // KEY_CHUNK) * KEY_CHUNK
        if attention_mask is None:
            slots = torch.arange(width)  # [width]
            return slots <= torch.arange(start, start + k).unsqueeze(1)  # [k, width]
        mask = torch.zeros(k, width, dtype=torch.bool)
        mask[:, :start] = True
        mask[:, start : start + k] = attention_mask.bool()
        return mask

    def _layer(
        self,
        index: int,
        layer: TorchLayer,
        hidden: torch.Tensor,  # [batch * k, hidden]
        batch: int,
        k: int,
        slots: list[tuple[int, int, int, int]],  # see _cache_segments
        rotation: torch.Tensor,  # [batch, k, 1, head_dim / 2] complex64
        blocked: torch.Tensor,  # [k, chunks * KEY_CHUNK] bool, True = may not attend
    ) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        normed = F.rms_norm(hidden, hidden.shape[-1:], layer.input_norm, eps)
        attn = self._attention(index, layer.qkv(normed), batch, k, slots, rotation, blocked)
        layer.o.add_into(hidden, attn)  # the residual stream is owned by forward: in place
        normed = F.rms_norm(hidden, hidden.shape[-1:], layer.post_attention_norm, eps)
        gate, up = layer.gate_up(normed).chunk(2, dim=-1)  # [batch * k, intermediate] each
        return layer.down.add_into(hidden, F.silu(gate).mul_(up))

    def _attention(
        self,
        index: int,
        qkv: torch.Tensor,  # [batch * k, q_size + 2 * kv_size]
        batch: int,
        k: int,
        slots: list[tuple[int, int, int, int]],  # see _cache_segments
        rotation: torch.Tensor,  # [batch, k, 1, head_dim / 2] complex64
        blocked: torch.Tensor,  # [k, chunks * KEY_CHUNK] bool, True = may not attend
    ) -> torch.Tensor:
        """Grouped-query attention whose per-query result does not depend on k.

        Scores are ``keys @ queries^T`` (the queries are the narrow side, a layout whose
        per-column result the matmul kernels keep for any column count) and values are
        reduced chunk by chunk with a fixed chunk length, the chunks summed in order.
        """
        cfg = self.config
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = heads // kv_heads
        width = blocked.shape[1]
        chunks = width // KEY_CHUNK
        qkv = qkv.view(batch, k, heads + 2 * kv_heads, d)
        pairs = torch.view_as_complex(qkv[:, :, : heads + kv_heads].unflatten(-1, (d // 2, 2)))
        rotated = torch.view_as_real(pairs * rotation).flatten(-2)  # [batch, k, h + kv, d]
        new_keys = rotated[:, :, heads:].transpose(1, 2)  # [batch, kv, k, d]
        new_values = qkv[:, :, heads + kv_heads :].transpose(1, 2)
        for chunk, first, last, token in slots:
            tokens = slice(token, token + last - first)
            self.k_cache[index, :, chunk, :, first:last] = new_keys[:, :, tokens]
            self.v_cache[index, :, chunk, :, first:last] = new_values[:, :, tokens]
        blocks = batch * chunks * kv_heads
        keys = self.k_cache[index, :, :chunks].reshape(blocks, KEY_CHUNK, d)
        values = self.v_cache[index, :, :chunks].reshape(blocks, KEY_CHUNK, d)
        queries = rotated[:, :, :heads].reshape(batch, 1, k, kv_heads, group * d)
        queries = queries.expand(batch, chunks, k, kv_heads, group * d).transpose(2, 3)
        queries = queries.reshape(blocks, k * group, d).transpose(1, 2)  # [blocks, d, k * g]
        scores = torch.bmm(keys, queries)  # [blocks, C, k * group]
        scores = scores.view(batch, chunks, kv_heads, KEY_CHUNK, k, group)
        scores = scores.permute(0, 2, 5, 4, 1, 3).reshape(batch, kv_heads, group, k, width)
        scores = scores.masked_fill_(blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, group * k, chunks, KEY_CHUNK)
        probs = probs.permute(0, 3, 1, 4, 2).reshape(blocks, KEY_CHUNK, group * k)
        parts = torch.bmm(values.transpose(1, 2), probs)  # [blocks, d, group * k]
        parts = parts.view(batch, chunks, kv_heads, d, group, k)
        out = parts[:, 0]
        for c in range(1, chunks):
            out = out + parts[:, c]  # fixed left-to-right order; all-masked chunks add 0
        out = out.permute(0, 4, 1, 3, 2)  # [batch, k, kv, group, d]
        return out.reshape(batch * k, cfg.q_size)
