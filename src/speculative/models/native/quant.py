"""Weight formats: GGUF block decoding and the packed layouts of the int8/int4 kernels.

A linear weight is ``[out_features, in_features]``. GGUF stores it row-major with blocks
of 32 consecutive input features, so rows can be permuted (RoPE un-permutation, q/k/v
fusion) without touching the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
_Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
_Q8_0_BLOCK_BYTES = 34  # fp16 d, 32 int8


@dataclass
class GroupQuant4:
    """Asymmetric 4-bit weights with one (scale, minimum) per group of 32 inputs.

    value = scale * q + minimum, q in 0..15 (the GGUF Q4_1 convention).
    """

    q: torch.Tensor  # [out, in] uint8 in 0..15
    scale: torch.Tensor  # [out, in // 32] float32
    minimum: torch.Tensor  # [out, in // 32] float32

    def dequantize(self) -> torch.Tensor:
        """Returns [out, in] float32."""
        out_features, in_features = self.q.shape
        groups = self.q.view(out_features, -1, GROUP_SIZE).float()  # [out, groups, 32]
        values = groups * self.scale.unsqueeze(-1) + self.minimum.unsqueeze(-1)
        return values.reshape(out_features, in_features)

    def select_rows(self, index: torch.Tensor) -> GroupQuant4:
        """Rows ``index`` (a permutation or subset). index: [rows] int64."""
        return GroupQuant4(self.q[index], self.scale[index], self.minimum[index])

    @staticmethod
    def concat(parts: list[GroupQuant4]) -> GroupQuant4:
        """Stack along the output dimension (q/k/v or gate/up fusion)."""
        return GroupQuant4(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.minimum for p in parts]),
        )


def decode_q4_1(raw: np.ndarray, shape: tuple[int, int]) -> GroupQuant4:
    """Decode GGUF Q4_1 bytes. raw: [out, in / 32 * 20] uint8; shape: (out, in)."""
    out_features, in_features = shape
    if in_features % GROUP_SIZE:
        raise ValueError(f"Q4_1 needs in_features divisible by 32, got {in_features}")
    blocks = np.ascontiguousarray(raw).reshape(out_features, in_features // GROUP_SIZE, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]  # [out, groups, 16]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [out, groups, 32]
    return GroupQuant4(
        q=torch.from_numpy(q.reshape(out_features, in_features).copy()),
        scale=torch.from_numpy(d),
        minimum=torch.from_numpy(m),
    )


def decode_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """Decode GGUF Q8_0 bytes to float32. raw: [out, in / 32 * 34] uint8. Returns [out, in]."""
    out_features, in_features = shape
    blocks = np.ascontiguousarray(raw).reshape(out_features, in_features // GROUP_SIZE, 34)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [out, groups, 1]
    qs = blocks[..., 2:].copy().view(np.int8).astype(np.float32)  # [out, groups, 32]
    return torch.from_numpy((qs * d).reshape(out_features, in_features))


def quantize_group4(weight: torch.Tensor) -> GroupQuant4:
    """Min/max asymmetric 4-bit quantization per 32 inputs. weight: [out, in] float32."""
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE:
        raise ValueError(f"int4 needs in_features divisible by 32, got {in_features}")
    groups = weight.float().reshape(out_features, -1, GROUP_SIZE)  # [out, groups, 32]
    low = groups.amin(dim=-1)  # [out, groups]
    high = groups.amax(dim=-1)  # [out, groups]
    scale = ((high - low) / 15).clamp_min(1e-12)  # [out, groups]
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    return GroupQuant4(q.to(torch.uint8).reshape(out_features, in_features), scale, low)


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8. weight: [out, in]. Returns ([out, in] int8, [out])."""
    scale = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
    q = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale
