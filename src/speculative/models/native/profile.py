"""Measure what verification costs: milliseconds per forward over k new tokens.

Speculative decoding pays when T(k) (a forward over k = gamma + 1 new tokens) is close to
T(1) (one decode step). ``measure_verify_cost`` times every k in interleaved rounds so slow
drifts of the machine (frequency, other load) hit all k alike, and reports medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch

from speculative.models.base import CausalLM


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


def _timed_forward(model: CausalLM, tokens: torch.Tensor) -> float:
    """Milliseconds of one forward over tokens [1, k]; the cache is restored afterwards."""
    start = time.perf_counter()
    model.forward(tokens)
    elapsed = (time.perf_counter() - start) * 1e3
    model.rollback(tokens.shape[1])
    return elapsed


def measure_verify_cost(
    model: CausalLM,
    ks: Iterable[int] = range(1, 17),
    context: int = 128,
    repeats: int = 7,
    warmup: int = 1,
    seed: int = 0,
) -> dict[int, float]:
    """Median ms of a forward over k new tokens after ``context`` cached tokens, per k.

    Rounds are interleaved (every k once per round) and the cache is rolled back after
    each timed call, so every measurement sees the same context.
    """
    ks = list(ks)
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must be non-empty positive block sizes, got {ks}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    max_length = model.max_length
    if max_length is not None and context + max(ks) > max_length:
        raise ValueError(f"context {context} + k {max(ks)} exceeds max_length {max_length}")
    generator = torch.Generator().manual_seed(seed)
    vocab = model.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=generator)  # [1, context]
    blocks = {k: torch.randint(0, vocab, (1, k), generator=generator) for k in ks}
    model.reset()
    model.forward(prompt)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for round_index in range(warmup + repeats):
        for k in ks:
            elapsed = _timed_forward(model, blocks[k])
            if round_index >= warmup:
                times[k].append(elapsed)
    model.reset()
    return {k: statistics.median(v) for k, v in times.items()}
