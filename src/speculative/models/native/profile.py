"""Weight bytes and the memory-bandwidth floor of a native model's decode step.

Timing forwards (the verify-cost curve T(k)/T(1)) is model-agnostic and lives in
:mod:`speculative.engine.costs`.
"""

from __future__ import annotations


def weight_bytes(model: object) -> int:
    """Bytes of weights a decode step reads (packed linears; embedding rows excluded)."""
    layers = getattr(model, "layers", None)
    head = getattr(model, "lm_head", None)
    if layers is None or head is None:
        raise ValueError("weight_bytes needs a NativeLlama-like model with layers and lm_head")
    total = head.weight_bytes()
    for layer in layers:
        total += layer.qkv.weight_bytes() + layer.o.weight_bytes()
        total += layer.gate_up.weight_bytes() + layer.down.weight_bytes()
        total += (layer.input_norm.numel() + layer.post_attention_norm.numel()) * 4
    return total


def bandwidth_floor_ms(weight_bytes: int, gbps: float = 22.0) -> float:
    """Time to stream ``weight_bytes`` once at ``gbps`` GB/s, in milliseconds."""
    if gbps <= 0:
        raise ValueError(f"gbps must be positive, got {gbps}")
    return weight_bytes / (gbps * 1e9) * 1e3
