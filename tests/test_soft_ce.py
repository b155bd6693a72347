"""The distillation loss's C kernel against the plain torch loss (training/soft_ce.py)."""

from __future__ import annotations

import pytest
import torch

from speculative.models.native.ckernels import KernelsUnavailable, load_kernels
from speculative.training import soft_ce as soft_ce_module
from speculative.training.soft_ce import KernelSoftCrossEntropy, torch_soft_cross_entropy


@pytest.fixture(scope="module")
def kernel() -> KernelSoftCrossEntropy:
    try:
        return KernelSoftCrossEntropy(load_kernels())
    except KernelsUnavailable as error:
        pytest.skip(f"C kernels unavailable: {error}")


def problem(rows: int, labels: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    label_logits = torch.randn(labels, n, generator=g) * 4  # [U, N]
    index = torch.randint(0, labels, (rows,), generator=g)  # [M]
    # the head's logits: the target's blurred, so that some rows agree at the top
    logits = label_logits[index] + torch.randn(rows, n, generator=g) * 3  # [M, N]
    logits = logits.to(dtype)
    weights = torch.rand(rows, generator=g) + 0.5  # [M] upstream gradient per row
    return logits, label_logits, index, weights


def loss_and_grad(loss_fn, logits, label_logits, index, weights):
    z = logits.clone().requires_grad_(True)
    loss, agree = loss_fn(z, label_logits, index)
    (loss * weights).sum().backward()
    return loss.detach(), agree, z.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 30, 4099), (5, 3, 7)])
def test_the_kernel_loss_and_gradient_are_the_plain_losss(kernel, dtype, shape):
    """Per-row loss to float32 rounding, top-1 agreement equal, the gradient (per-row
    upstream weights, in the logits' dtype) to float32 rounding, in bf16 all but a few
    elements bitwise (a rounding boundary apart). Widths with a tail past the 8-lane
    vectors. The control: the kernel scoring each row against the next row's labels (a
    wrong index map) is far outside those tolerances."""
    logits, label_logits, index, weights = problem(*shape[:2], shape[2], dtype)
    want, want_agree, want_grad = loss_and_grad(
        torch_soft_cross_entropy, logits, label_logits, index, weights
    )
    got, agree, grad = loss_and_grad(kernel, logits, label_logits, index, weights)
    assert got.dtype == torch.float32 and grad.dtype == dtype
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(agree, want_agree) and bool(agree.any()) and not bool(agree.all())
    if dtype == torch.float32:
        assert torch.allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
    else:
        assert float((grad != want_grad).float().mean()) < 0.01
        # one bf16 rounding step, or float32 cancellation in q * sum(p) - p
        assert torch.allclose(grad.float(), want_grad.float(), rtol=2**-8, atol=1e-6)
    shifted, _, shifted_grad = loss_and_grad(kernel, logits, label_logits, index.roll(1), weights)
    assert not torch.allclose(shifted, want, rtol=1e-2)
    assert not torch.allclose(shifted_grad.float(), want_grad.float(), rtol=1e-2, atol=1e-3)


def test_a_nan_logit_makes_its_rows_loss_nan_and_no_other(kernel):
    logits, label_logits, index, weights = problem(6, 4, 100, torch.float32)
    logits[2, 57] = float("nan")
    got, agree, grad = loss_and_grad(kernel, logits, label_logits, index, weights)
    want, _, want_grad = loss_and_grad(
        torch_soft_cross_entropy, logits, label_logits, index, weights
    )
    assert torch.isnan(got[2]) and torch.isnan(grad[2]).all() and not agree[2]
    keep = torch.arange(6) != 2
    assert torch.allclose(got[keep], want[keep], rtol=1e-5)
    assert torch.allclose(grad[keep], want_grad[keep], rtol=1e-4, atol=1e-6)


def test_bad_inputs_are_refused_before_the_kernel_reads_them(kernel):
    logits, label_logits, index, _ = problem(4, 3, 16, torch.float32)
    with pytest.raises(IndexError, match="label row index is out of range"):
        kernel(logits, label_logits, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="do not fit"):
        kernel(logits, label_logits[:, :8], index)
    with pytest.raises(ValueError, match="float32 or bf16"):
        kernel(logits.half(), label_logits, index)


def test_the_trainer_takes_the_kernel_where_it_builds_and_torch_elsewhere(monkeypatch):
    chosen = soft_ce_module.soft_cross_entropy_for_this_machine()
    try:
        load_kernels()
        assert isinstance(chosen, KernelSoftCrossEntropy)
    except KernelsUnavailable:
        assert chosen is torch_soft_cross_entropy

    def unavailable():
        raise KernelsUnavailable("no C compiler (cc/gcc) found")

    monkeypatch.setattr(soft_ce_module, "load_kernels", unavailable)
    assert soft_ce_module.soft_cross_entropy_for_this_machine() is torch_soft_cross_entropy
