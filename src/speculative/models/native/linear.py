"""Pre-packed linear layers, one class per precision.

Every layer maps float32 activations ``[tokens, in]`` to float32 ``[tokens, out]``; what
happens in between (weight format, activation dtype, kernel) defines the precision. Weights
are packed once at construction so no call re-packs or re-casts them.

Row invariance: every layer returns, for each row, bitwise the same values whatever the
number of rows in the call (speculative verification over k tokens must reproduce k single
decode steps exactly). The oneDNN bf16, int8 and int4 kernels are row invariant as they
are; MKL's fp32 path is not at one row (it switches to a gemv with another summation
order), so ``Fp32Linear`` runs a single row as two.
"""

from __future__ import annotations

from typing import Protocol

import torch

from speculative.models.native.quant import (
    GROUP_SIZE,
    GroupQuant4,
    quantize_group4,
    quantize_int8_per_channel,
)

PRECISIONS = ("fp32", "bf16", "int8", "int4")


class PackedLinear(Protocol):
    """``y = x @ W.T + b`` with a pre-packed ``W``."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in] float32
        ...

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += x @ W.T + b`` in place (out: [tokens, out] float32); returns out."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of weight data read by one call (weights + scales)."""
        ...


class _LowPrecisionLinear:
    """Shared call/accumulate logic for kernels that return bfloat16 ``[tokens, out]``."""

    bias: torch.Tensor | None

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] f32 -> bf16
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in] float32
        y = self._kernel(x).float()  # [tokens, out]
        return y if self.bias is None else y + self.bias

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return out.add_(self(x))
        # float32 += bfloat16 computes in float32 on the exact upcast: same bits as
        # out + y.float(), one op (and one temporary) fewer
        return out.add_(self._kernel(x))


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by the given tensors (None entries count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Fp32Linear:
    """float32 weights, packed once for MKL's sgemm (no per-call repacking).

    MKL computes a one-row product with a gemv whose rounding differs from its gemm, so
    a single row is duplicated to two; results then agree bitwise for 1 to 16 rows.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # weight: [out, in] float32; bias: [out] or None
        self.weight = weight.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = self.weight.shape[0]
        self._use_mkl = torch.backends.mkl.is_available()
        self._packed = (
            torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1) if self._use_mkl else None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in]
        rows = x.shape[0]
        if rows == 1:
            x = x.expand(2, -1).contiguous()  # keep the gemm path (row invariance)
        if self._packed is None:
            y = torch.nn.functional.linear(x, self.weight, self.bias)
        else:
            y = torch.ops.mkl._mkl_linear(x, self._packed, self.weight, self.bias, x.shape[0])
        return y[:1] if rows == 1 else y

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return out.add_(self(x))

    def weight_bytes(self) -> int:
        return tensor_bytes(self.weight, self.bias)


class Bf16Linear(_LowPrecisionLinear):
    """bfloat16 weights and activations (float32 accumulation), packed for oneDNN."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # weight: [out, in]; bias: [out] or None
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = self.weight.shape[0]
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in] float32
        return torch.ops.mkldnn._linear_pointwise(
            x.to(torch.bfloat16), self._packed, None, "none", [], ""
        )  # [tokens, out] bfloat16

    def weight_bytes(self) -> int:
        return tensor_bytes(self.weight, self.bias)


class Int8Linear(_LowPrecisionLinear):
    """Weight-only int8 with one scale per output channel (bfloat16 activations)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # weight: [out, in]; bias: [out] or None
        self.qweight, scale = quantize_int8_per_channel(weight.float())
        self.scale = scale.to(torch.bfloat16)  # [out]
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = self.qweight.shape[0]

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in] float32
        return torch.ops.aten._weight_int8pack_mm(
            x.to(torch.bfloat16), self.qweight, self.scale
        )  # [tokens, out] bfloat16

    def weight_bytes(self) -> int:
        return tensor_bytes(self.qweight, self.scale, self.bias)


class Int4Linear(_LowPrecisionLinear):
    """Weight-only asymmetric int4, groups of 32 inputs (bfloat16 activations).

    Runs GGUF Q4_1 values as stored: Q4_1 is ``d * q + m``, the kernel computes
    ``(q - 8) * scale + zero``, so ``scale = d`` and ``zero = m + 8 d``.
    """

    def __init__(self, weight: torch.Tensor | GroupQuant4, bias: torch.Tensor | None) -> None:
        quant = weight if isinstance(weight, GroupQuant4) else quantize_group4(weight.float())
        out_features, in_features = quant.q.shape
        if out_features % 16 or in_features % GROUP_SIZE:
            raise ValueError(
                f"int4 needs out_features % 16 == 0 and in_features % 32 == 0, got "
                f"{tuple(quant.q.shape)}"
            )
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            quant.q.to(torch.int32).contiguous(), 1
        )
        zero = quant.minimum + 8 * quant.scale  # [out, groups]
        self.scale_zero = (
            torch.stack([quant.scale, zero], dim=-1).transpose(0, 1).contiguous()
        ).to(torch.bfloat16)  # [groups, out, 2]
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = out_features

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in] float32
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scale_zero
        )  # [tokens, out] bfloat16

    def weight_bytes(self) -> int:
        return tensor_bytes(self.packed, self.scale_zero, self.bias)


def make_linear(
    weight: torch.Tensor | GroupQuant4, bias: torch.Tensor | None, precision: str
) -> PackedLinear:
    """A packed layer for ``precision``. weight: [out, in]; bias: [out] or None."""
    if precision == "int4":
        return Int4Linear(weight, bias)
    dense = weight.dequantize() if isinstance(weight, GroupQuant4) else weight
    if precision == "fp32":
        return Fp32Linear(dense, bias)
    if precision == "bf16":
        return Bf16Linear(dense, bias)
    if precision == "int8":
        return Int8Linear(dense, bias)
    raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
