"""Measured costs of any :class:`~speculative.models.base.CausalLM`.

- ``T(k)``: wall time of one forward of ``k`` new tokens after a fixed context (the
  verification pass scores k = γ + 1 tokens). Timings of all k are interleaved, the cache
  is rolled back after each forward, and each k's median is kept, so machine drift hits
  every k alike. The curve is reported as ``T(k)/T(1)`` (exactly 1 at k = 1).
- ``c``: the draft cost, ms of one draft step ÷ ms of one target decode step, measured
  interleaved on the same context. A model-free drafter's step is its ``propose`` call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from speculative.drafters.base import Drafter, SupportsPriming
from speculative.models.base import CausalLM, RowInput, SupportsBatchRows
from speculative.models.session import ModelSession
from speculative.sampling import SamplingParams


@dataclass(frozen=True)
class TargetCosts:
    """A target's measured decode step and verify-cost curve."""

    step_ms: float  # T(1) in milliseconds
    verify_cost: dict[int, float]  # k -> T(k)/T(1), k = 1..max_k

    def to_dict(self) -> dict[str, object]:
        return {
            "step_ms": self.step_ms,
            "verify_cost": {str(k): v for k, v in self.verify_cost.items()},
        }


def _ids(tokens: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(tokens)], dtype=torch.long)  # [1, k]


def _timed_ms(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000.0


def _probe_tokens(context: Sequence[int], count: int) -> list[int]:
    """``count`` real token ids to feed after the context (the context's own, cycled)."""
    if not context:
        raise ValueError("the cost context must hold at least one token")
    return [context[i % len(context)] for i in range(count)]


def _prefill(model: CausalLM, context: Sequence[int]) -> None:
    model.reset()
    model.forward(_ids(context))


def forward_ms(
    model: CausalLM,
    context: Sequence[int],
    ks: Sequence[int],
    repeats: int = 5,
    warmup: int = 1,
) -> dict[int, float]:
    """Median ms of one forward of ``k`` new tokens after ``context``, for each k in ``ks``.

    The k values are interleaved within each repeat; the cache is rolled back after every
    forward and reset at the end.
    """
    return interleaved_forward_ms([model], context, ks, repeats, warmup)[0]


def interleaved_forward_ms(
    models: Sequence[CausalLM],
    context: Sequence[int],
    ks: Sequence[int],
    repeats: int = 5,
    warmup: int = 1,
) -> list[dict[int, float]]:
    """:func:`forward_ms` for several models, their timings interleaved with each other."""
    if repeats < 1 or not ks or min(ks) < 1:
        raise ValueError("need repeats >= 1 and token counts k >= 1")
    probe = _probe_tokens(context, max(ks))
    for model in models:
        _prefill(model, context)
    samples: list[dict[int, list[float]]] = [{k: [] for k in ks} for _ in models]
    with torch.inference_mode():
        for repeat in range(warmup + repeats):
            for k in ks:
                for model, times in zip(models, samples, strict=True):
                    elapsed = _timed_ms(lambda m=model, n=k: m.forward(_ids(probe[:n])))
                    model.rollback(k)
                    if repeat >= warmup:
                        times[k].append(elapsed)
    for model in models:
        model.reset()
    return [{k: statistics.median(v) for k, v in times.items()} for times in samples]


def verify_cost_curve(
    model: CausalLM, context: Sequence[int], max_k: int, repeats: int = 5
) -> TargetCosts:
    """T(k)/T(1) for k = 1..max_k, measured on ``model`` after ``context``."""
    times = forward_ms(model, context, range(1, max_k + 1), repeats)
    step = times[1]
    curve = {k: (1.0 if k == 1 else times[k] / step) for k in times}
    return TargetCosts(step_ms=step, verify_cost=curve)


def model_draft_cost(
    draft: CausalLM, target: CausalLM, context: Sequence[int], repeats: int = 5
) -> float:
    """c = ms of one draft forward ÷ ms of one target decode step (interleaved medians)."""
    draft_ms, target_ms = interleaved_forward_ms([draft, target], context, [1], repeats)
    return draft_ms[1] / target_ms[1]


def propose_ms(drafter: Drafter, context: Sequence[int], repeats: int = 5) -> float:
    """Median ms of one ``propose`` of a single token after ``context`` (greedy)."""
    params = SamplingParams(temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    drafter.reset()
    drafter.propose(context, 1, params, generator)  # warm-up (and catch-up for models)
    times = [
        _timed_ms(lambda: drafter.propose(context, 1, params, generator)) for _ in range(repeats)
    ]
    drafter.reset()
    return statistics.median(times)


def drafter_cost(
    drafter: Drafter,
    draft_model: CausalLM | None,
    target: CausalLM,
    context: Sequence[int],
    target_step_ms: float,
    repeats: int = 5,
) -> float:
    """c for a drafter: a model's forward vs the target's (interleaved), else its propose."""
    if draft_model is not None:
        cost = model_draft_cost(draft_model, target, context, repeats)
        drafter.reset()  # the drafter's session must not trust the model's cache any more
        return cost
    if isinstance(drafter, SupportsPriming):  # heads read the target's features
        session = ModelSession(target)
        session.sync(list(context)[:-1])
        drafter.prime(session)
    cost = propose_ms(drafter, context, repeats) / target_step_ms
    target.reset()
    return cost


def interleaved_prefill_ms(
    models: Sequence[CausalLM], length: int, repeats: int = 3, warmup: int = 1
) -> list[float]:
    """Median ms of one forward over ``length`` prompt tokens from an empty cache, for each
    model, the models interleaved within each round."""
    if repeats < 1 or length < 1:
        raise ValueError("need repeats >= 1 and a prompt of at least one token")
    samples: list[list[float]] = [[] for _ in models]
    with torch.inference_mode():
        for repeat in range(warmup + repeats):
            for model, times in zip(models, samples, strict=True):
                prompt = _ids([(i * 7919) % model.vocab_size for i in range(length)])
                model.reset()
                elapsed = _timed_ms(lambda m=model, p=prompt: m.forward(p))
                if repeat >= warmup:
                    times.append(elapsed)
    for model in models:
        model.reset()
    return [statistics.median(times) for times in samples]


def rows_verify_cost(
    model: SupportsBatchRows,
    context: Sequence[int],
    points: Sequence[int],
    repeats: int = 5,
    rows: int = 8,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[int, float]:
    """T(n)/T(1) of one batched pass (``forward_rows``) of n tokens spread over ``rows``
    sequences (1..⌈n/rows⌉ tokens each, as in a batched round), each after ``context``;
    the n values are interleaved and every slot is rolled back after each pass.
    ``clock``: e.g. ``time.process_time`` on one thread when other jobs share the cores."""
    if repeats < 1 or not points or min(points) < 1 or not context:
        raise ValueError("need repeats >= 1, token counts n >= 1 and a context")
    probe = _probe_tokens(context, max(points))
    slots = [model.acquire_slot() for _ in range(rows)]
    try:
        model.forward_rows([RowInput(s, torch.tensor(list(context))) for s in slots])
        times: dict[int, list[float]] = {n: [] for n in points}
        for repeat in range(repeats + 1):  # the first round warms up
            for n in points:
                sizes = [n // rows + (i < n % rows) for i in range(rows)]
                batch = [
                    RowInput(s, torch.tensor(probe[:k]))
                    for s, k in zip(slots, sizes, strict=True)
                    if k
                ]
                started = clock()
                model.forward_rows(batch)
                elapsed = clock() - started
                for row in batch:
                    model.rollback_slot(row.slot, row.input_ids.numel())
                if repeat:
                    times[n].append(elapsed)
    finally:
        for s in slots:
            model.release_slot(s)
    base = statistics.median(times[min(points)])
    return {n: statistics.median(t) / base for n, t in times.items()}
