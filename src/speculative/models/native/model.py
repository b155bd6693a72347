"""A compact Llama-architecture decoder with a static, position-indexed KV cache.

Covers Llama / SmolLM2 / Mistral (no sliding window) and Qwen2 (q/k/v biases): RMSNorm,
RoPE (with llama3 scaling), grouped-query attention, SwiGLU, tied or untied embeddings.
q/k/v and gate/up projections are fused into one packed matrix each, so a layer makes
four weight passes.

Cache slots are filled in call order (slot = cache_length + j for the j-th new token);
RoPE positions are a separate input, so a token tree can be verified in one call by
passing its depth-based ``position_ids`` and an ancestor ``attention_mask``.

k-invariance: the logits of a token do not depend on how many tokens share its forward
(a block of k for speculative verification or one decode step at a time). Every op works
row by row with kernels whose per-row result does not depend on the row count, and
attention reduces over keys in fixed chunks of ``KEY_CHUNK`` cache slots (masked slots
contribute exact zeros), so block and step forwards agree bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculative.models.native.config import NativeConfig, rope_inverse_frequencies
from speculative.models.native.linear import PRECISIONS, PackedLinear, make_linear
from speculative.models.native.loading import Checkpoint, Weight, rope_interleave_index
from speculative.models.native.quant import GroupQuant4

KEY_CHUNK = 128  # cache slots per attention chunk; attention reads whole chunks


@dataclass
class NativeLayer:
    """One decoder block's packed weights."""

    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    qkv: PackedLinear  # hidden -> q_size + 2 * kv_size
    o: PackedLinear  # q_size -> hidden
    gate_up: PackedLinear  # hidden -> 2 * intermediate
    down: PackedLinear  # intermediate -> hidden


def _concat_rows(parts: list[Weight]) -> Weight:
    if all(isinstance(p, GroupQuant4) for p in parts):
        return GroupQuant4.concat(parts)  # type: ignore[arg-type]
    return torch.cat([p.dequantize() if isinstance(p, GroupQuant4) else p for p in parts])


def _select_rows(weight: Weight, index: torch.Tensor) -> Weight:
    """Rows ``index`` of a weight [out, in] or a bias [out]. index: [rows] int64."""
    if isinstance(weight, GroupQuant4):
        return weight.select_rows(index)
    return weight[index].contiguous()


def _scale_rows(weight: Weight, factor: float) -> Weight:
    """``factor * weight`` (exact for GroupQuant4 scale/min when factor is a power of two)."""
    if isinstance(weight, GroupQuant4):
        return GroupQuant4(weight.q, weight.scale * factor, weight.minimum * factor)
    return weight * factor


def _query_key_tensors(
    checkpoint: Checkpoint, prefix: str, suffix: str
) -> tuple[Weight, Weight, Weight] | None:
    """q, k, v weights (or biases) with q/k rows interleaved and q pre-scaled by 1/sqrt(d)."""
    cfg = checkpoint.config
    keys = [f"{prefix}self_attn.{p}_proj.{suffix}" for p in ("q", "k", "v")]
    if not all(k in checkpoint.tensors for k in keys):
        return None
    q, k, v = (checkpoint.tensors[key] for key in keys)
    if checkpoint.qk_layout == "half":
        q = _select_rows(q, rope_interleave_index(cfg.q_size, cfg.num_heads))
        k = _select_rows(k, rope_interleave_index(cfg.kv_size, cfg.num_kv_heads))
    return _scale_rows(q, cfg.head_dim**-0.5), k, v


def build_layer(checkpoint: Checkpoint, index: int, precision: str) -> NativeLayer:
    """Fuse and pack the weights of decoder layer ``index``.

    q/k rows are stored in RoPE-interleaved order (both sides of q.k permuted alike, so
    attention is unchanged) and q carries the 1/sqrt(head_dim) softmax scale.
    """
    prefix = f"model.layers.{index}."
    t = checkpoint.tensors
    qkv_weights = _query_key_tensors(checkpoint, prefix, "weight")
    if qkv_weights is None:
        raise ValueError(f"layer {index} lacks q/k/v projection weights")
    qkv_biases = _query_key_tensors(checkpoint, prefix, "bias")
    qkv_bias = None if qkv_biases is None else torch.cat([b.float() for b in qkv_biases])
    gate_up = _concat_rows([t[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")])
    return NativeLayer(
        input_norm=checkpoint.dense(f"{prefix}input_layernorm.weight"),
        post_attention_norm=checkpoint.dense(f"{prefix}post_attention_layernorm.weight"),
        qkv=make_linear(_concat_rows(list(qkv_weights)), qkv_bias, precision),
        o=make_linear(t[f"{prefix}self_attn.o_proj.weight"], None, precision),
        gate_up=make_linear(gate_up, None, precision),
        down=make_linear(t[f"{prefix}mlp.down_proj.weight"], None, precision),
    )


def lm_head_precision(precision: str) -> str:
    """The output projection keeps 8 bits under int4 (as llama.cpp's Q4 files do)."""
    return "int8" if precision == "int4" else precision


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


class NativeLlama:
    """Llama-family causal LM implementing :class:`speculative.models.base.CausalLM`."""

    def __init__(self, checkpoint: Checkpoint, precision: str = "fp32", max_length: int = 2048):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        cfg = checkpoint.config
        self.config: NativeConfig = cfg
        self.precision = precision
        self.name = f"{checkpoint.name}-native-{precision}"
        self._max_length = max_length
        self.embed = checkpoint.dense("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = [build_layer(checkpoint, i, precision) for i in range(cfg.num_layers)]
        self.final_norm = checkpoint.dense("model.norm.weight")  # [hidden]
        head_key = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head = make_linear(checkpoint.tensors[head_key], None, lm_head_precision(precision))
        inv_freq = rope_inverse_frequencies(cfg)  # [head_dim // 2]
        angles = torch.outer(torch.arange(max_length, dtype=torch.float32), inv_freq)
        self.rotations = torch.polar(torch.ones_like(angles), angles)  # [max_length, d/2]
        self._length = 0
        self._batch = 0
        self._chunks = -(-max_length // KEY_CHUNK)
        # [layers, batch, chunks, kv_heads, KEY_CHUNK, head_dim]; slot s lives in chunk
        # s // KEY_CHUNK at offset s % KEY_CHUNK. Zero-initialised, so unused slots are finite.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    # ---- protocol -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    @property
    def max_length(self) -> int:
        return self._max_length

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (see :func:`profile.weight_bytes`)."""
        from speculative.models.native.profile import weight_bytes

        return weight_bytes(self)

    @property
    def cache_length(self) -> int:
        return self._length

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot roll back {n} of {self._length} cached positions")
        self._length -= n

    def reset(self) -> None:
        self._length = 0

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
        batch, k = self._check_input(input_ids)
        start = self._length
        self._ensure_cache(batch)
        positions = self._positions(position_ids, batch, k, start)  # [batch, k]
        rotation = self.rotations[positions].unsqueeze(2)  # [batch, k, 1, head_dim / 2]
        blocked = ~self._visibility(attention_mask, k, start)  # [k, chunks * KEY_CHUNK]
        slots = _cache_segments(start, k)
        hidden = self.embed[input_ids].reshape(batch * k, -1)  # [batch * k, hidden], a copy
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, batch, k, slots, rotation, blocked)
        hidden = F.rms_norm(hidden, hidden.shape[-1:], self.final_norm, self.config.rms_norm_eps)
        logits = self.lm_head(hidden)  # [batch * k, vocab]
        self._length = start + k
        return logits.reshape(batch, k, -1)

    __call__ = forward

    # ---- internals ------------------------------------------------------------------
    def _check_input(self, input_ids: torch.Tensor) -> tuple[int, int]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, k], got shape {tuple(input_ids.shape)}")
        batch, k = input_ids.shape
        if k == 0:
            raise ValueError("input_ids must hold at least one token")
        if self._length + k > self._max_length:
            raise ValueError(
                f"cache overflow: {self._length} cached + {k} new > max_length {self._max_length}"
            )
        return batch, k

    def _ensure_cache(self, batch: int) -> None:
        if batch == self._batch:
            return
        if self._length:
            raise ValueError(f"batch changed from {self._batch} to {batch} with a non-empty cache")
        cfg = self.config
        shape = (cfg.num_layers, batch, self._chunks, cfg.num_kv_heads, KEY_CHUNK, cfg.head_dim)
        self.k_cache = torch.zeros(shape)
        self.v_cache = torch.zeros(shape)
        self._batch = batch

    def _positions(
        self, position_ids: torch.Tensor | None, batch: int, k: int, start: int
    ) -> torch.Tensor:
        if position_ids is None:
            return torch.arange(start, start + k).expand(batch, k)
        positions = position_ids.long().reshape(-1, k).expand(batch, k)  # [batch, k]
        if positions.min() < 0 or positions.max() >= self._max_length:
            raise ValueError(f"position_ids must lie in [0, {self._max_length})")
        return positions

    def _visibility(self, attention_mask: torch.Tensor | None, k: int, start: int) -> torch.Tensor:
        """Which cache slots each new token sees: [k, chunks * KEY_CHUNK] bool.

        Covers whole chunks up to the last new slot; slots past it are never visible.
        """
        width = -(-(start + k) // KEY_CHUNK) * KEY_CHUNK
        if attention_mask is None:
            slots = torch.arange(width)  # [width]
            return slots <= torch.arange(start, start + k).unsqueeze(1)  # [k, width]
        if attention_mask.shape != (k, k):
            raise ValueError(
                f"attention_mask must be [k, k] = [{k}, {k}], got {tuple(attention_mask.shape)}"
            )
        mask = torch.zeros(k, width, dtype=torch.bool)
        mask[:, :start] = True
        mask[:, start : start + k] = attention_mask.bool()
        return mask

    def _layer(
        self,
        index: int,
        layer: NativeLayer,
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
