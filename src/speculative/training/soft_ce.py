"""The distillation loss: soft cross-entropy of the head's distribution against the
target's, row by row.

For row i, with the head's logits z [N] and the target's logits l [N] over the draft
vocabulary, ``loss_i = -sum_j p_j log q_j`` where ``p = softmax(l)`` and
``q = softmax(z)``. Two implementations with one signature (:class:`SoftCrossEntropy`):

- :data:`torch_soft_cross_entropy`, the plain one (and the reference);
- :class:`KernelSoftCrossEntropy`, the C kernels' fused forward and backward. Through
  torch each stage is a pass that writes a fresh [rows, N] float32 tensor; the kernel keeps
  a row of z and of l in cache from its first read to its last and writes only the
  gradient. The same loss to float32 rounding (a test holds the two together).

:func:`soft_cross_entropy_for_this_machine` picks the kernel where the C library builds.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from speculative.models.native.ckernels import KernelsUnavailable, load_kernels


class SoftCrossEntropy(Protocol):
    name: str  # what a training report calls it

    def __call__(
        self,
        logits: torch.Tensor,  # [M, N] the head's (float32 or bf16), differentiable
        label_logits: torch.Tensor,  # [U, N] float32 the target's
        index: torch.Tensor,  # [M] int64: row i is scored against label_logits[index[i]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-row loss [M] float32, per-row top-1 agreement [M] bool: the head's and
        the target's largest logit at the same token)."""
        ...


class TorchSoftCrossEntropy:
    """The loss in plain torch (float32 softmaxes; autograd for the gradient)."""

    name = "torch"

    def __call__(
        self, logits: torch.Tensor, label_logits: torch.Tensor, index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        targets = label_logits[index]  # [M, N]
        p = torch.softmax(targets, dim=-1)
        logq = torch.log_softmax(logits.float(), dim=-1)
        agree = logits.detach().argmax(-1) == targets.argmax(-1)
        return -(p * logq).sum(-1), agree


torch_soft_cross_entropy = TorchSoftCrossEntropy()


class KernelSoftCrossEntropy:
    """The loss through the C kernels (``spec_soft_ce``, forward and backward)."""

    name = "C kernel"

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library

    def __call__(
        self, logits: torch.Tensor, label_logits: torch.Tensor, index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"logits must be float32 or bf16, not {logits.dtype}")
        loss, top_q, top_p = _KernelLoss.apply(logits, label_logits, index, self.library)
        return loss, (top_q == top_p) & (top_q >= 0)  # -1: a row with a NaN


def soft_cross_entropy_for_this_machine() -> SoftCrossEntropy:
    """The C kernel where the library builds and loads here, else the torch loss."""
    try:
        return KernelSoftCrossEntropy(load_kernels())
    except KernelsUnavailable:
        return torch_soft_cross_entropy


class _KernelLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label_logits, index, library):  # type: ignore[override]
        z = logits.detach().contiguous()  # [M, N]
        labels = label_logits.detach().float().contiguous()  # [U, N]
        rows_index = index.to(torch.int64).contiguous()  # [M]
        m, n = z.shape
        if labels.shape[1] != n or rows_index.shape != (m,):
            shapes = f"{tuple(z.shape)}, {tuple(labels.shape)}, {tuple(index.shape)}"
            raise ValueError(f"logits, label logits and index of shapes {shapes} do not fit")
        if m and (int(rows_index.min()) < 0 or int(rows_index.max()) >= labels.shape[0]):
            raise IndexError("a label row index is out of range")
        stats = torch.empty(4, m)  # loss, lse(z), lse(l), sum(p)
        top = torch.empty(2, m, dtype=torch.int32)  # argmax of z, of l
        _run(library, z, labels, rows_index, stats, top=top)
        ctx.save_for_backward(z, labels, rows_index, stats)
        ctx.library = library
        top_q, top_p = top.unbind(0)
        ctx.mark_non_differentiable(top_q, top_p)
        return stats[0].clone(), top_q, top_p

    @staticmethod
    def backward(ctx, grad_loss, _grad_top_q, _grad_top_p):  # type: ignore[override]
        z, labels, rows_index, stats = ctx.saved_tensors
        grad = torch.empty_like(z)
        _run(ctx.library, z, labels, rows_index, stats, scale=grad_loss.float(), grad=grad)
        return grad, None, None, None


def _run(
    library: ctypes.CDLL,
    z: torch.Tensor,  # [M, N] float32 or bf16
    labels: torch.Tensor,  # [U, N] float32
    index: torch.Tensor,  # [M] int64
    stats: torch.Tensor,  # [4, M] float32
    top: torch.Tensor | None = None,  # [2, M] int32: the forward writes it
    scale: torch.Tensor | None = None,  # [M] float32: the backward reads it
    grad: torch.Tensor | None = None,  # like z: the backward writes it
) -> None:
    """spec_soft_ce: the forward without ``grad``, the backward with it."""
    m, n = z.shape
    scale = None if scale is None else scale.contiguous()  # held while the kernel reads it
    library.spec_soft_ce(
        z.data_ptr(), int(z.dtype == torch.bfloat16), labels.data_ptr(), index.data_ptr(),
        m, n, stats.data_ptr(), None if top is None else top.data_ptr(),
        None if scale is None else scale.data_ptr(),
        None if grad is None else grad.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
