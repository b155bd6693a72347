"""The dtype a head's matmuls train at on this CPU: ``fp32``, or ``bf16`` where the CPU
has native bf16 dot products.

Training a head is almost all matmuls (the decoder layer's projections and the draft
vocabulary's logits). On a CPU with AVX512-BF16 or AMX-BF16, oneDNN runs them in bf16
(float32 accumulation) at 2-4x the float32 rate; elsewhere bf16 is emulated and slower
than float32. ``auto`` picks by the CPU's flags (and ``ONEDNN_MAX_CPU_ISA``, which can
forbid oneDNN those instructions), so the same command trains fast on either machine.
``bf16`` trains the head's forward under torch's CPU autocast: the matmuls take bf16
inputs, so the activations between them are bf16; parameters, gradients, optimizer
state, the loss's softmaxes and the target's soft labels stay float32. Drafting is
unaffected (a trained head drafts in float32; verification keeps the output exact
whatever the head).
"""

from __future__ import annotations

from speculative.hardware import CpuInfo, cpu_info

CHOICES = ("auto", "fp32", "bf16")
RESOLVED = ("fp32", "bf16")  # what a trainer runs ("auto" resolved)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def onednn_allows_bf16(max_isa: str | None) -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` (None: unset) leaves oneDNN its bf16 instructions."""
    if not max_isa:
        return True
    value = max_isa.strip().upper()
    return value in ("ALL", "DEFAULT") or "BF16" in value or "AMX" in value


def native_bf16(cpu: CpuInfo) -> bool:
    """The CPU has native bf16 dot products and oneDNN may use them."""
    has_flag = any(flag in cpu.isa for flag in NATIVE_BF16_FLAGS)
    return has_flag and onednn_allows_bf16(cpu.settings.get("ONEDNN_MAX_CPU_ISA"))


def resolve_matmul_precision(setting: str, cpu: CpuInfo | None = None) -> str:
    """``fp32`` or ``bf16`` for a ``--matmul-precision`` setting (``auto`` asks ``cpu``,
    this machine's by default)."""
    if setting not in CHOICES:
        choices = ", ".join(CHOICES)
        raise ValueError(f"unknown matmul precision {setting!r}; choose one of {choices}")
    if setting != "auto":
        return setting
    return "bf16" if native_bf16(cpu or cpu_info()) else "fp32"
