"""Decoder-layer weights as both native decoders consume them (fused, not yet packed).

q/k/v and gate/up projections are fused into one matrix each, so a layer makes four
weight passes. q/k rows are stored in RoPE-interleaved order (both sides of q.k permuted
alike, so attention is unchanged) and q carries the 1/sqrt(head_dim) softmax scale; where
each query and key head has its own RMSNorm (Qwen3), the norms' weights take the same
order and the query norm carries the scale instead (a norm would undo it on q's rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculative.models.native.loading import Checkpoint, Weight, rope_interleave_index
from speculative.models.native.quant import GroupQuant4


@dataclass
class LayerWeights:
    """One decoder block: norms plus four fused weight matrices [out, in]."""

    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2) or None
    qk_norm: torch.Tensor | None  # [2, head_dim]: the query heads' norm, then the key heads'
    # (Qwen3), RoPE-interleaved, the query's scaled by 1/sqrt(head_dim); or None
    o: Weight  # [hidden, q_size]
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]


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
    checkpoint: Checkpoint, prefix: str, suffix: str, scaled: bool
) -> tuple[Weight, Weight, Weight] | None:
    """q, k, v weights (or biases) with q/k rows interleaved and, when ``scaled``, q
    pre-scaled by 1/sqrt(d)."""
    cfg = checkpoint.config
    keys = [f"{prefix}self_attn.{p}_proj.{suffix}" for p in ("q", "k", "v")]
    if not all(k in checkpoint.tensors for k in keys):
        return None
    q, k, v = (checkpoint.tensors[key] for key in keys)
    if checkpoint.qk_layout == "half":
        q = _select_rows(q, rope_interleave_index(cfg.q_size, cfg.num_heads))
        k = _select_rows(k, rope_interleave_index(cfg.kv_size, cfg.num_kv_heads))
    return (_scale_rows(q, cfg.head_dim**-0.5) if scaled else q), k, v


def _query_key_norms(checkpoint: Checkpoint, prefix: str) -> torch.Tensor | None:
    """Qwen3's per-head query and key RMSNorm weights as [2, head_dim], in the order the
    q/k rows take, the query's carrying the 1/sqrt(d) softmax scale; None without them."""
    keys = [f"{prefix}self_attn.{p}_norm.weight" for p in ("q", "k")]
    if not any(k in checkpoint.tensors for k in keys):
        return None
    if not all(k in checkpoint.tensors for k in keys):
        raise ValueError(f"{prefix}self_attn has a query or a key norm but not both")
    d = checkpoint.config.head_dim
    norms = torch.stack([checkpoint.dense(key) for key in keys])  # [2, d]
    if norms.shape != (2, d):
        raise ValueError(f"{prefix}self_attn's q/k norms are {tuple(norms.shape[1:])}, not [{d}]")
    if checkpoint.qk_layout == "half":
        norms = norms[:, rope_interleave_index(d, 1)]
    return norms * torch.tensor([[d**-0.5], [1.0]])


def layer_weights(checkpoint: Checkpoint, index: int) -> LayerWeights:
    """The fused weights of decoder layer ``index``."""
    prefix = f"model.layers.{index}."
    t = checkpoint.tensors
    qk_norm = _query_key_norms(checkpoint, prefix)
    qkv_weights = _query_key_tensors(checkpoint, prefix, "weight", scaled=qk_norm is None)
    if qkv_weights is None:
        raise ValueError(f"layer {index} lacks q/k/v projection weights")
    qkv_biases = _query_key_tensors(checkpoint, prefix, "bias", scaled=qk_norm is None)
    qkv_bias = None if qkv_biases is None else torch.cat([b.float() for b in qkv_biases])
    return LayerWeights(
        input_norm=checkpoint.dense(f"{prefix}input_layernorm.weight"),
        post_attention_norm=checkpoint.dense(f"{prefix}post_attention_layernorm.weight"),
        qkv=_concat_rows(list(qkv_weights)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        o=t[f"{prefix}self_attn.o_proj.weight"],
        gate_up=_concat_rows([t[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")]),
        down=t[f"{prefix}mlp.down_proj.weight"],
    )
