"""Pre-packed linear layers for the PyTorch decoder, one class per precision, and the
choice between a precision's library kernel and its portable twin.

Every layer maps float32 activations ``[tokens, in]`` to float32 ``[tokens, out]``; what
happens in between (weight format, activation dtype, kernel) defines the precision. Weights
are packed once at construction so no call re-packs or re-casts them.

Row invariance (a token's output does not depend on how many tokens share the call) is
not asked of these kernels: none of the libraries promises it, and on some CPUs MKL's
sgemm and ATen's int8/int4 kernels round differently for different row counts. The
PyTorch decoder instead always calls them with the same number of rows, a number at which
each row computes alike in every position (``torch_decoder.uniform_row_tile``), which
makes every token's result the same by construction.

Where a precision's library kernel cannot run on this CPU (oneDNN's bf16 kernels need
AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and honour ``ONEDNN_MAX_CPU_ISA``), the layer runs
its *dequantized* twin: MKL's fp32 gemm over the exact float32 values of the same weights
(bf16 and Q4_1 values are exact in float32). ``SPECULATIVE_TORCH_LINEAR`` (``auto`` |
``library`` | ``dequantized``) pins the choice: ``library`` fails with a one-line reason
naming the missing CPU feature; ``dequantized`` tests the portable twin on any CPU.

:data:`LINEAR_PRECISIONS` holds, per precision, its library kernel and its exact values:
a new precision is its layer class plus one line there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from speculative.models.native.loading import Weight  # [out, in], dense or Q4_1 as stored
from speculative.models.native.quant import (
    GROUP_SIZE,
    GroupQuant4,
    quantize_group4,
    quantize_int8_per_channel,
)

LINEAR_ENV = "SPECULATIVE_TORCH_LINEAR"
LINEAR_MODES = ("auto", "library", "dequantized")


class PackedLinear(Protocol):
    """``y = x @ W.T + b`` with a pre-packed ``W``."""

    out_features: int
    kernel: str  # which kernel runs it, e.g. "onednn-bf16" or "mkl-fp32(dequantized bf16)"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in] float32
        ...

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += x @ W.T + b`` in place (out: [tokens, out] float32); returns out."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of weight data read by one call (weights + scales)."""
        ...


class LinearKernelUnavailable(ValueError):
    """A linear kernel cannot run on this CPU (the reason is the message). A ValueError
    so the CLI reports it in one line."""


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by the given tensors (None entries count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


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


class Fp32Linear:
    """float32 weights, packed once for MKL's sgemm (no per-call repacking)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str = "mkl-fp32"
    ) -> None:
        # weight: [out, in] float32; bias: [out] or None
        self.weight = weight.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = self.weight.shape[0]
        self._use_mkl = torch.backends.mkl.is_available()
        self._packed = (
            torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1) if self._use_mkl else None
        )
        self.kernel = kernel if self._use_mkl else kernel.replace("mkl", "aten")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in]
        if self._packed is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self._packed, self.weight, self.bias, x.shape[0])

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return out.add_(self(x))

    def weight_bytes(self) -> int:
        return tensor_bytes(self.weight, self.bias)


class Bf16Linear(_LowPrecisionLinear):
    """bfloat16 weights and activations (float32 accumulation), packed for oneDNN."""

    kernel = "onednn-bf16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # weight: [out, in]; bias: [out] or None
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = self.weight.shape[0]
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
        except RuntimeError as error:  # oneDNN checks the CPU (and ONEDNN_MAX_CPU_ISA)
            raise LinearKernelUnavailable(
                "oneDNN's bf16 kernels need avx512bw + avx512vl + avx512dq or avx_ne_convert,"
                f" which this CPU (or ONEDNN_MAX_CPU_ISA) does not offer ({_first_line(error)})"
            ) from error

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, in] float32
        return torch.ops.mkldnn._linear_pointwise(
            x.to(torch.bfloat16), self._packed, None, "none", [], ""
        )  # [tokens, out] bfloat16

    def weight_bytes(self) -> int:
        return tensor_bytes(self.weight, self.bias)


class Int8Linear(_LowPrecisionLinear):
    """Weight-only int8 with one scale per output channel (bfloat16 activations)."""

    kernel = "aten-int8"

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

    kernel = "aten-int4"

    def __init__(self, weight: Weight, bias: torch.Tensor | None) -> None:
        quant = as_group_quant4(weight)
        out_features, in_features = quant.q.shape
        if out_features % 16 or in_features % GROUP_SIZE:
            raise LinearKernelUnavailable(
                f"ATen's int4 kernel needs out_features % 16 == 0 and in_features % 32 == 0,"
                f" got {tuple(quant.q.shape)}"
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


def as_group_quant4(weight: Weight) -> GroupQuant4:
    """Q4_1 weights as stored, or a dense [out, in] weight quantized to them."""
    return weight if isinstance(weight, GroupQuant4) else quantize_group4(weight.float())


def dense_values(weight: Weight) -> torch.Tensor:
    """The [out, in] float32 values of a dense or Q4_1 weight (Q4_1 is exact in float32)."""
    return (weight.dequantize() if isinstance(weight, GroupQuant4) else weight).float()


def _bf16_values(weight: Weight) -> torch.Tensor:
    return dense_values(weight).to(torch.bfloat16).float()


def _int8_values(weight: Weight) -> torch.Tensor:
    """``q * scale`` with the float32 per-channel scale the C kernels use."""
    qweight, scale = quantize_int8_per_channel(dense_values(weight))
    return qweight.float() * scale[:, None]


def _int4_values(weight: Weight) -> torch.Tensor:
    """Q4_1's ``d * q + m`` (fp16 d and m): exact in float32."""
    return as_group_quant4(weight).dequantize()


@dataclass(frozen=True)
class LinearPrecision:
    """How layers of one precision run on PyTorch. ``library`` packs the precision's
    library kernel (:class:`LinearKernelUnavailable` where it cannot run here);
    ``values`` gives the exact float32 values [out, in] that kernel multiplies by, which
    its *dequantized* twin runs with MKL's fp32 gemm."""

    library: Callable[[Weight, torch.Tensor | None], PackedLinear]
    values: Callable[[Weight], torch.Tensor]
    twin: str  # the dequantized twin's kernel name


LINEAR_PRECISIONS: dict[str, LinearPrecision] = {
    "fp32": LinearPrecision(lambda w, b: Fp32Linear(dense_values(w), b), dense_values, "mkl-fp32"),
    "bf16": LinearPrecision(
        lambda w, b: Bf16Linear(dense_values(w), b), _bf16_values, "mkl-fp32(dequantized bf16)"
    ),
    "int8": LinearPrecision(
        lambda w, b: Int8Linear(dense_values(w), b), _int8_values, "mkl-fp32(dequantized int8)"
    ),
    "int4": LinearPrecision(Int4Linear, _int4_values, "mkl-fp32(dequantized int4)"),
}
PRECISIONS = tuple(LINEAR_PRECISIONS)


def dequantized_values(weight: Weight, precision: str) -> torch.Tensor:
    """The exact float32 values [out, in] a layer of ``precision`` multiplies by."""
    return LINEAR_PRECISIONS[precision].values(weight)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _dequantized(weight: Weight, bias: torch.Tensor | None, precision: str) -> PackedLinear:
    """The precision's portable twin: MKL's fp32 gemm over its exact values."""
    spec = LINEAR_PRECISIONS[precision]
    return Fp32Linear(spec.values(weight), bias, spec.twin)


def linear_mode_from_env() -> str:
    """The ``SPECULATIVE_TORCH_LINEAR`` setting (``auto`` when unset)."""
    mode = os.environ.get(LINEAR_ENV, "auto").strip().lower() or "auto"
    if mode not in LINEAR_MODES:
        raise ValueError(f"{LINEAR_ENV}={mode!r}: expected one of {LINEAR_MODES}")
    return mode


@dataclass
class LinearFactory:
    """Packs the layers of one model at one precision.

    mode: ``auto`` (the library kernel, or the dequantized twin where it cannot run here),
    ``library`` (that kernel or a :class:`LinearKernelUnavailable` error) or ``dequantized``.
    """

    precision: str
    mode: str = "auto"
    chosen: dict[str, str] = field(default_factory=dict)  # "out x in" -> kernel that runs it

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; expected one of {PRECISIONS}")
        if self.mode not in LINEAR_MODES:
            raise ValueError(f"unknown linear mode {self.mode!r}; expected one of {LINEAR_MODES}")

    def __call__(self, weight: Weight, bias: torch.Tensor | None) -> PackedLinear:
        """A packed layer. weight: [out, in] (dense or Q4_1); bias: [out] or None."""
        layer = self._build(weight, bias)
        out_features, in_features = (weight.q if isinstance(weight, GroupQuant4) else weight).shape
        self.chosen.setdefault(f"{out_features}x{in_features}", layer.kernel)
        return layer

    def _build(self, weight: Weight, bias: torch.Tensor | None) -> PackedLinear:
        if self.mode == "dequantized":
            return _dequantized(weight, bias, self.precision)
        try:
            return LINEAR_PRECISIONS[self.precision].library(weight, bias)
        except LinearKernelUnavailable:
            if self.mode == "library":
                raise
            return _dequantized(weight, bias, self.precision)
