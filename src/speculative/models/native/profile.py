"""Weight bytes and the memory-bandwidth floor of a native model's decode step.

Timing forwards (the verify-cost curve T(k)/T(1)) is model-agnostic and lives in
:mod:`speculative.engine.costs`.
"""

from __future__ import annotations


def weight_bytes(model: object) -> int:
    """Bytes of weights a decode step reads (packed linears; embedding rows excluded)."""
    measure = getattr(model, "weight_bytes", None)
    if not callable(measure):
        raise ValueError("weight_bytes needs a model with a weight_bytes() method")
    return int(measure())


def bandwidth_floor_ms(weight_bytes: int, gbps: float = 22.0) -> float:
    """Time to stream ``weight_bytes`` once at ``gbps`` GB/s, in milliseconds."""
    if gbps <= 0:
        raise ValueError(f"gbps must be positive, got {gbps}")
    return weight_bytes / (gbps * 1e9) * 1e3
