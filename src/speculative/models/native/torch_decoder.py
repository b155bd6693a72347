"""The PyTorch decoder of the native runtime: the portable fallback and the reference.

Runs anywhere PyTorch runs (no C compiler needed); :mod:`.ckernels` is the fast path.
Linear layers are pre-packed for MKL / oneDNN, or run their dequantized twin where this
CPU lacks the library kernel's instruction set (see :mod:`.linear`).

k-invariance by construction: a forward runs its tokens in tiles of exactly T rows (the
last one padded), so every op — linear layers, norms, attention — always sees the same
shapes and computes a token's values with the same instructions whatever the number of
tokens in the call. No library promises that its result for one row does not depend on
the number of rows (MKL's sgemm and ATen's int8 / int4 kernels round differently for
different row counts on some CPUs), so nothing relies on it. Nor does any promise that a
row's result does not depend on its position in the call: MKL's AVX2 sgemm on Intel CPUs
runs rows in blocks of 6, and rows 7 and 8 of an 8-row call round differently from the
first six. So T is probed when the decoder is built (:func:`uniform_row_tile`): the
largest of ``ROW_TILES`` at which every linear layer gives each row the same bits in
every position; a token then computes alike in whichever row of a tile it lands. Attention
reduces over keys in fixed chunks of ``KEY_CHUNK`` cache slots, summed left to right;
masked slots and chunks add exact zeros, so the number of chunks a call covers does not
change a token's result either. Block and step forwards agree bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculative.models.native.config import NativeConfig
from speculative.models.native.decoder_base import DecoderBase, PackedLayer, Segment
from speculative.models.native.layers import LayerWeights
from speculative.models.native.linear import LinearFactory, PackedLinear, linear_mode_from_env
from speculative.models.native.loading import Weight
from speculative.models.precision import traits

KEY_CHUNK = 128  # cache slots per attention chunk; attention reads whole chunks
ROW_TILES = (8, 6, 4, 2, 1)  # tile sizes tried, largest first (k <= T: one pass)
MAX_ROW_TILE = ROW_TILES[0]


def position_uniform(linear: PackedLinear, in_features: int, rows: int) -> bool:
    """Whether ``linear`` gives a row the same bits in every position of a ``rows``-row
    call: the call on random rows, rolled by one, equals the call on the rolled rows. (A
    position whose code path differs from its neighbour's shows up at their boundary.)"""
    if rows == 1:
        return True
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    return torch.equal(linear(x).roll(1, 0), linear(x.roll(1, 0)))


def uniform_row_tile(linears: Sequence[tuple[PackedLinear, int]]) -> int:
    """The largest tile of ``ROW_TILES`` at which every (linear, in_features) is
    position-uniform (:func:`position_uniform`)."""
    return next(t for t in ROW_TILES if all(position_uniform(lin, n, t) for lin, n in linears))


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
        linear_mode: str | None = None,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        """linear_mode: which linear kernels to try (see :class:`LinearFactory`); None
        reads ``SPECULATIVE_TORCH_LINEAR`` (default ``auto``). kv_dtype: the cache's
        elements, float32 or float16 (stored rounded to nearest even, read back exactly,
        as the C kernels do)."""
        super().__init__()
        self.slot_dim = 1
        self.config = config
        self.kv_dtype = kv_dtype
        mode = linear_mode_from_env() if linear_mode is None else linear_mode
        make_linear = LinearFactory(precision, mode)
        self.layers = [PackedLayer.pack(w, make_linear) for w in layers]
        self.final_norm = final_norm
        self.lm_head = LinearFactory(traits(precision).lm_head, mode)(head, None)
        self.kernels = {**make_linear.chosen, "lm_head": self.lm_head.kernel}  # shape -> kernel
        probes = [(self.lm_head, config.hidden_size)]  # (linear, in_features)
        if self.layers:
            first = self.layers[0]
            probes += [
                (first.qkv, config.hidden_size),
                (first.o, config.q_size),
                (first.gate_up, config.hidden_size),
                (first.down, config.intermediate_size),
            ]
        self.row_tile = uniform_row_tile(probes)  # T: rows per tile
        self.rotations = rotations
        self.max_positions = rotations.shape[0]
        # (layers, [len(layers), rows, hidden]): where forwards copy those layers' states
        self._layer_out: tuple[tuple[int, ...], torch.Tensor] | None = None

    def copy_layers_into(self, layers: Sequence[int], out: torch.Tensor | None) -> None:
        """See :meth:`DecoderBase.copy_layers_into`."""
        self._layer_out = None if out is None else (tuple(layers), out)

    def cache_shape(self, batch: int, positions: int) -> tuple[int, ...]:
        """[layers, batch, chunks, kv_heads, KEY_CHUNK, head_dim]: slot s lives in chunk
        s // KEY_CHUNK at offset s % KEY_CHUNK; padding rows of the last tile write (never
        read) slots up to T - 1 past the end."""
        cfg = self.config
        chunks = -(-(positions + MAX_ROW_TILE - 1) // KEY_CHUNK)
        return (cfg.num_layers, batch, chunks, cfg.num_kv_heads, KEY_CHUNK, cfg.head_dim)

    def copy_cache_from(
        self,
        source: TorchDecoder,
        length: int,
        source_slot: int = 0,
        target_slot: int = 0,
        start: int = 0,
    ) -> None:
        """See :meth:`DecoderBase.copy_cache_from`."""
        self.hold_positions(length)
        s, t, layers = source_slot, target_slot, self.config.num_layers
        for chunk in range(start // KEY_CHUNK, -(-length // KEY_CHUNK)):
            first = chunk * KEY_CHUNK
            kept = slice(max(start, first) - first, min(length, first + KEY_CHUNK) - first)
            self.k_cache[:, t, chunk, :, kept] = source.k_cache[:layers, s, chunk, :, kept]
            self.v_cache[:, t, chunk, :, kept] = source.v_cache[:layers, s, chunk, :, kept]

    def keep_slots(self, first: int, slots: list[int], cache_slot: int | None = None) -> None:
        """Move cache slots ``slots`` (increasing, >= first) to first, first + 1, ... of
        sequence ``cache_slot`` (every sequence when None), in order: a destination never
        lies after a source still to be read."""
        caches = (self.k_cache, self.v_cache)
        if cache_slot is not None:
            caches = tuple(cache.narrow(1, cache_slot, 1) for cache in caches)
        for target, source in enumerate(slots, start=first):
            (tc, to), (sc, so) = divmod(target, KEY_CHUNK), divmod(source, KEY_CHUNK)
            for cache in caches:
                cache[:, :, tc, :, to] = cache[:, :, sc, :, so]

    def forward_segments(
        self,
        hidden: torch.Tensor,  # [rows, hidden] float32 embeddings, owned: left holding the
        # features; segment i owns the next segments[i].rows rows
        segments: Sequence[Segment],
    ) -> torch.Tensor:  # [sum of logit_rows, vocab]
        """One sequence at a time (the reference the C batch is tested against)."""
        self.hold_positions(max((s.start + s.rows for s in segments), default=0))
        logits = []
        first = 0
        for segment in segments:
            rows = slice(first, first + segment.rows)
            logits.append(self._forward_one(hidden[rows], segment, first)[segment.logits_from :])
            first += segment.rows
        return torch.cat(logits) if logits else torch.empty(0, self.vocab_size)

    def _forward_one(
        self,
        hidden: torch.Tensor,  # [k, hidden], updated in place into the features
        segment: Segment,
        row0: int = 0,  # the segment's first row in the call (where its layer states go)
    ) -> torch.Tensor:  # [k, vocab]
        k, start = segment.rows, segment.start
        positions = segment.rope_positions()  # [k]
        visible = self._visibility(segment.mask, k, start)  # [k, start + k]
        logits = torch.empty(k, self.vocab_size)
        for first in range(0, k, self.row_tile):
            rows = min(self.row_tile, k - first)
            tile = _Tile.make(start, first, rows, visible, self.row_tile)
            rotation = self.rotations[positions[tile.tokens]].unsqueeze(1)  # [T, 1, d/2]
            residual = hidden[tile.tokens]  # [T, hidden], a copy: left holding the features
            logits[first : first + rows] = self._tile(
                residual, segment.slot, tile, rotation, row0 + first
            )
            hidden[first : first + rows] = residual[:rows]
        return logits

    @staticmethod
    def _visibility(attention_mask: torch.Tensor | None, k: int, start: int) -> torch.Tensor:
        """Which slots each new token sees: [k, start + k] bool (the cache, then the new
        tokens in call order). A token may see only itself and earlier tokens."""
        visible = torch.ones(k, start + k, dtype=torch.bool)
        if attention_mask is None:
            visible[:, start:] = torch.ones(k, k, dtype=torch.bool).tril()
            return visible
        mask = attention_mask.bool()
        if mask.triu(1).any():
            raise ValueError("attention_mask lets a token see a later token of the same call")
        visible[:, start:] = mask
        return visible

    def _tile(
        self,
        hidden: torch.Tensor,  # [T, hidden] embeddings (padding: copies), updated in place
        # into the features (the final residual stream after the final norm)
        b: int,
        tile: _Tile,
        rotation: torch.Tensor,  # [T, 1, head_dim / 2] complex64
        row0: int = 0,  # the tile's first row in the call
    ) -> torch.Tensor:  # [rows, vocab]
        """Run one tile of sequence ``b`` through every layer and the output head."""
        wanted = self._layer_out
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, b, tile, rotation)
            if wanted is not None and index in wanted[0]:
                wanted[1][wanted[0].index(index), row0 : row0 + tile.rows] = hidden[: tile.rows]
        eps = self.config.rms_norm_eps
        hidden.copy_(F.rms_norm(hidden, hidden.shape[-1:], self.final_norm, eps))
        return self.lm_head(hidden)[: tile.rows]

    def _layer(
        self,
        index: int,
        layer: PackedLayer[PackedLinear],
        hidden: torch.Tensor,  # [T, hidden], the residual stream, updated in place
        b: int,
        tile: _Tile,
        rotation: torch.Tensor,  # [T, 1, head_dim / 2] complex64
    ) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        normed = F.rms_norm(hidden, hidden.shape[-1:], layer.input_norm, eps)
        qkv = layer.qkv(normed)  # [T, q_size + 2 * kv_size]
        if layer.qk_norm is not None:
            qkv = self._head_normed(qkv, layer.qk_norm)
        attn = self._attention(index, qkv, b, tile, rotation)
        layer.o.add_into(hidden, attn)
        normed = F.rms_norm(hidden, hidden.shape[-1:], layer.post_attention_norm, eps)
        gate, up = layer.gate_up(normed).chunk(2, dim=-1)  # [T, intermediate] each
        return layer.down.add_into(hidden, F.silu(gate).mul_(up))

    def _head_normed(
        self,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]
        qk_norm: torch.Tensor,  # [2, head_dim]: query heads' weights, key heads'
    ) -> torch.Tensor:  # [T, q_size + 2 * kv_size]
        """Every query head and every key head RMS-normed with its own weights (Qwen3)."""
        cfg = self.config
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        split = qkv.view(qkv.shape[0], heads + 2 * kv_heads, d)
        eps = cfg.rms_norm_eps
        queries = F.rms_norm(split[:, :heads], (d,), qk_norm[0], eps)
        keys = F.rms_norm(split[:, heads : heads + kv_heads], (d,), qk_norm[1], eps)
        return torch.cat([queries, keys, split[:, heads + kv_heads :]], dim=1).view_as(qkv)

    def _attention(
        self,
        index: int,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]
        b: int,
        tile: _Tile,
        rotation: torch.Tensor,  # [T, 1, head_dim / 2] complex64
    ) -> torch.Tensor:  # [T, q_size]
        """Grouped-query attention of one tile; a token's result does not depend on the
        tile it is in nor on how many chunks the tile covers.

        Scores are ``keys @ queries^T`` per (kv head, token, chunk): a batch of small
        products of identical shapes, one per token, so no token's sums depend on where
        it sits in the tile (a single product over all tokens' queries put some of them
        in a library kernel's edge columns, which round differently). The softmax is taken
        chunk-wise against the row maximum and its normalizer, and the value sums add the
        chunks left to right (masked chunks add exact zeros).
        """
        cfg = self.config
        tokens = self.row_tile
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = heads // kv_heads
        chunks = tile.blocked.shape[1] // KEY_CHUNK
        qkv = qkv.view(tokens, heads + 2 * kv_heads, d)
        pairs = torch.view_as_complex(qkv[:, : heads + kv_heads].unflatten(-1, (d // 2, 2)))
        rotated = torch.view_as_real(pairs * rotation).flatten(-2)  # [T, h + kv, d]
        self._store(index, b, tile.start, rotated[:, heads:], qkv[:, heads + kv_heads :])
        keys = self.k_cache[index, b, :chunks].transpose(0, 1).float()  # [kv, chunks, C, d]
        values = self.v_cache[index, b, :chunks].transpose(0, 1).float()  # [kv, chunks, C, d]
        queries = rotated[:, :heads].reshape(tokens, kv_heads, group, d)
        queries = queries.permute(1, 0, 3, 2).unsqueeze(2)  # [kv, T, 1, d, group]
        scores = keys.unsqueeze(1) @ queries  # [kv, T, chunks, C, group]
        scores = scores.permute(0, 4, 1, 2, 3).contiguous()  # [kv, group, T, chunks, C]
        scores.masked_fill_(tile.blocked.view(tokens, chunks, KEY_CHUNK), float("-inf"))
        top = scores.amax(dim=(-2, -1), keepdim=True)  # [kv, group, T, 1, 1]
        weights = torch.exp(scores - top)  # [kv, group, T, chunks, C]; masked: 0
        chunk_sums = weights.sum(dim=-1)  # [kv, group, T, chunks]
        weights = weights.permute(0, 2, 3, 1, 4)  # [kv, T, chunks, group, C]
        parts = weights @ values.unsqueeze(1)  # [kv, T, chunks, group, d]
        total, out = chunk_sums[..., 0], parts[:, :, 0]  # [kv, group, T], [kv, T, group, d]
        for c in range(1, chunks):  # left to right; chunks nobody sees add exact zeros
            total = total + chunk_sums[..., c]
            out = out + parts[:, :, c]
        out = out / total.permute(0, 2, 1).unsqueeze(-1)  # [kv, T, group, d]
        return out.permute(1, 0, 2, 3).reshape(tokens, cfg.q_size)

    def _store(
        self,
        index: int,
        b: int,
        start: int,
        keys: torch.Tensor,  # [T, kv, d]
        values: torch.Tensor,  # [T, kv, d]
    ) -> None:
        """Write the tile's keys and values (padding rows included) at slots start..."""
        for chunk, first, last, token in _cache_segments(start, self.row_tile):
            rows = slice(token, token + last - first)
            self.k_cache[index, b, chunk, :, first:last] = keys[rows].transpose(0, 1)
            self.v_cache[index, b, chunk, :, first:last] = values[rows].transpose(0, 1)


@dataclass
class _Tile:
    """One tile of a forward: ``rows`` real tokens (the rest padding) at cache slots
    ``start`` .. and what each of its row-tile rows may see."""

    start: int
    rows: int
    tokens: torch.Tensor  # [T] int64: the call's token each row runs (padding: the last)
    blocked: torch.Tensor  # [T, chunks * KEY_CHUNK] bool, True = may not attend

    @classmethod
    def make(cls, start: int, first: int, rows: int, visible: torch.Tensor, row_tile: int) -> _Tile:
        """Tile of new tokens first .. first + rows - 1 of a call that starts at slot
        ``start``; visible: [k, start + k] bool (see TorchDecoder._visibility).

        Padding rows repeat the last real token (embedding, position, visibility); their
        outputs are dropped and their cache slots, past every real token of the call,
        are overwritten before anything reads them."""
        slot = start + first  # the tile's first cache slot
        width = -(-(slot + row_tile) // KEY_CHUNK) * KEY_CHUNK
        tokens = first + torch.arange(row_tile).clamp_max(rows - 1)  # [row_tile]
        seen = torch.zeros(row_tile, width, dtype=torch.bool)
        seen[:, : slot + rows] = visible[tokens, : slot + rows]
        return cls(start=slot, rows=rows, tokens=tokens, blocked=~seen)
