"""Measured costs of any :class:`~speculative.models.base.CausalLM`.

- ``T(k)``: wall time of one forward of ``k`` new tokens after a fixed context (the
  verification pass scores k = γ + 1 tokens). Timings of all k are interleaved, the cache
  is rolled back after each forward, and each k's median is kept, so machine drift hits
  every k alike. The curve is reported as ``T(k)/T(1)`` (exactly 1 at k = 1).
- ``c``: the draft cost, ms of one draft step ÷ ms of one target decode step, measured
  interleaved on the same context. A model-free drafter's step is its ``propose`` call.
- Round overhead: the wall time of a generation round outside the target's forwards and
  the drafter's calls (sampling, verification, bookkeeping, session sync), measured by
  timing those calls inside real generations (:func:`round_overheads`).
- Where a C forward's time goes, op by op (:func:`kernel_op_ms`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch

from speculative.capabilities import provides
from speculative.drafters.base import Drafter, SupportsPriming
from speculative.engine.loop import SpeculativeEngine
from speculative.engine.stopping import StopCriteria
from speculative.models.base import (
    KERNEL_OPS,
    CausalLM,
    ClocksKernelOps,
    RowInput,
    SupportsBatchRows,
)
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


def probe_context(vocab_size: int, length: int = 64) -> list[int]:
    """A fixed context of ``length`` token ids spread over the vocabulary, for timing
    passes after it (the same on every call, so measurements compare)."""
    return [(i * 7919) % vocab_size for i in range(length)]


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


def kernel_op_ms(
    model: CausalLM,
    context: Sequence[int],
    ks: Sequence[int],
    repeats: int = 5,
    warmup: int = 1,
) -> dict[int, dict[str, float]] | None:
    """Where one forward of k new tokens after ``context`` spends its time, for each k in
    ``ks``: the median ms of every op of the C forward (:data:`KERNEL_OPS`, summed over
    the layers), then "outside": the rest of the forward call's wall time (Python, the
    embedding lookup, the call into C). The k values are interleaved within each repeat;
    None when ``model`` cannot clock its ops (:class:`ClocksKernelOps`)."""
    if not provides(model, ClocksKernelOps) or repeats < 1 or not ks:
        return None
    clock = cast(ClocksKernelOps, model)
    seconds = torch.zeros(len(KERNEL_OPS), dtype=torch.float64)  # [ops], the forward adds
    if not clock.clock_kernel_ops(seconds):
        return None
    probe = _probe_tokens(context, max(ks))
    samples: dict[int, list[list[float]]] = {k: [] for k in ks}  # per k: [ops + outside]
    try:
        _prefill(model, context)
        with torch.inference_mode():
            for repeat in range(warmup + repeats):
                for k in ks:
                    seconds.zero_()
                    elapsed = _timed_ms(lambda n=k: model.forward(_ids(probe[:n])))
                    model.rollback(k)
                    ops = (seconds * 1000.0).tolist()
                    if repeat >= warmup:
                        samples[k].append([*ops, elapsed - sum(ops)])
    finally:
        clock.clock_kernel_ops(None)
        model.reset()
    names = (*KERNEL_OPS, "outside")
    return {
        k: {name: statistics.median(row[i] for row in rows) for i, name in enumerate(names)}
        for k, rows in samples.items()
    }


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
    """c = ms of one draft forward ÷ ms of one target decode step (interleaved medians).
    A draft model with cache slots is timed in a slot of its own, as its drafters run it
    (their slots, slot 0 among them, may hold rows)."""
    with _as_one_sequence(draft) as timed:
        draft_ms, target_ms = interleaved_forward_ms([timed, target], context, [1], repeats)
    return draft_ms[1] / target_ms[1]


@contextmanager
def _as_one_sequence(model: CausalLM) -> Iterator[CausalLM]:
    """``model`` itself, or one of its cache slots seen as a single sequence (acquired
    here, freed on exit) where it has slots."""
    if not provides(model, SupportsBatchRows):
        yield model
        return
    view = _SlotSequence(model)
    try:
        yield view  # type: ignore[misc]
    finally:
        model.release_slot(view.slot)


class _SlotSequence:
    """The forward / rollback / reset of a single sequence, run in one cache slot."""

    def __init__(self, model: SupportsBatchRows) -> None:
        self.model = model
        self.slot = model.acquire_slot()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, k] int64 -> [1, k, vocab] logits."""
        return self.model.forward_rows([RowInput(self.slot, input_ids[0])])[0].unsqueeze(0)

    def rollback(self, n: int) -> None:
        self.model.rollback_slot(self.slot, n)

    def reset(self) -> None:
        self.rollback(self.model.slot_length(self.slot))


def propose_ms(
    drafter: Drafter,
    context: Sequence[int],
    repeats: int = 5,
    between: Callable[[], object] | None = None,
) -> float:
    """Median ms of one ``propose`` of a single token after ``context`` (greedy);
    ``between`` (untimed) runs before each timed call."""
    params = SamplingParams(temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    drafter.reset()
    drafter.propose(context, 1, params, generator)  # warm-up (and catch-up for models)
    times = []
    for _ in range(repeats):
        if between is not None:
            between()
        times.append(_timed_ms(lambda: drafter.propose(context, 1, params, generator)))
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
    between = None
    if isinstance(drafter, SupportsPriming):  # heads read the target's features
        session = ModelSession(target)
        session.sync(list(context)[:-1])
        drafter.prime(session)
        probe = _ids(_probe_tokens(context, 1))

        def between() -> None:
            """A target step (rolled back) before each draft step, as in decoding: the
            target's weights stream through the caches and evict the head's."""
            with torch.inference_mode():
                target.forward(probe)
            target.rollback(1)

    cost = propose_ms(drafter, context, repeats, between) / target_step_ms
    target.reset()
    return cost


def interleaved_prefill_ms(
    models: Sequence[CausalLM], length: int, repeats: int = 3, warmup: int = 1
) -> list[float]:
    """Median ms of one prefill of ``length`` prompt tokens from an empty cache, as decoding
    runs it (a session's pass that wants the last token's logits only), for each model, the
    models interleaved within each round."""
    if repeats < 1 or length < 1:
        raise ValueError("need repeats >= 1 and a prompt of at least one token")
    samples: list[list[float]] = [[] for _ in models]
    with torch.inference_mode():
        for repeat in range(warmup + repeats):
            for model, times in zip(models, samples, strict=True):
                prompt = probe_context(model.vocab_size, length)
                session = ModelSession(model)  # an empty cache
                elapsed = _timed_ms(lambda s=session, p=prompt: s.logits_after(p))
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
    every slot is rolled back after each pass. Each repeat sweeps the n values, starting
    one further along each time (no n always follows the largest), and divides by its own
    T(smallest n); the ratio is the median over repeats (drift between repeats cancels).
    ``clock``: e.g. ``time.process_time`` on one thread when other jobs share the cores."""
    if repeats < 1 or not points or min(points) < 1 or not context:
        raise ValueError("need repeats >= 1, token counts n >= 1 and a context")
    probe = _probe_tokens(context, max(points))
    slots = [model.acquire_slot() for _ in range(rows)]
    try:
        model.forward_rows([RowInput(s, torch.tensor(list(context))) for s in slots])
        ratios: dict[int, list[float]] = {n: [] for n in points}
        order = sorted(set(points))
        for repeat in range(repeats + 1):  # the first round warms up
            times: dict[int, float] = {}
            shift = repeat % len(order)
            for n in [*order[shift:], *order[:shift]]:
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
                times[n] = elapsed
            if repeat:
                for n in order:
                    ratios[n].append(times[n] / times[order[0]])
    finally:
        for s in slots:
            model.release_slot(s)
    return {n: statistics.median(r) for n, r in ratios.items()}


TOKEN_POINTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass(frozen=True)
class PassCostCurves:
    """The two measured curves of a batched pass's cost ``T(r, n) = K(n) + R(r) − K(r)``
    (:class:`~speculative.engine.gamma.LoadAwareGamma`), each ÷ its own T(1)."""

    tokens: dict[int, float]  # n -> K(n)/T(1): n tokens in one row
    rows: dict[int, float]  # r -> R(r)/T(1): r rows of one token each

    def to_dict(self) -> dict[str, object]:
        return {
            "tokens": {str(n): v for n, v in self.tokens.items()},
            "rows": {str(r): v for r, v in self.rows.items()},
        }


def pass_cost_curves(
    model: SupportsBatchRows,
    context: Sequence[int],
    max_rows: int,
    max_tokens: int = 128,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> PassCostCurves:
    """K(n) for n up to ``max_tokens`` (one row) and R(r) for r = 1..``max_rows`` (one token
    a row), each after ``context`` (:func:`rows_verify_cost`)."""
    points = [n for n in TOKEN_POINTS if n <= max_tokens] or [1]
    tokens = rows_verify_cost(model, context, points, repeats, 1, clock)
    if max_rows <= 1:
        return PassCostCurves(tokens, {1: 1.0})
    rows = rows_verify_cost(model, context, range(1, max_rows + 1), repeats, max_rows, clock)
    return PassCostCurves(tokens, rows)


# ---- time per round outside the forwards ----------------------------------------------

TARGET_CALLS = ("forward", "forward_with_hidden", "forward_tree", "forward_from")
DRAFTER_CALLS = ("propose", "propose_tree", "observe")


@dataclass
class CallClock:
    """Seconds spent inside the timed calls of one object (nested calls counted once)."""

    seconds: float = 0.0
    depth: int = 0


@contextmanager
def timed_calls(obj: object, names: Sequence[str], clock: CallClock) -> Iterator[None]:
    """Time ``obj``'s methods ``names`` (those it has) into ``clock`` while inside; the
    wrappers are instance attributes, removed on exit (the class methods then show
    again). Costs two perf_counter calls per timed call."""
    wrapped = [name for name in names if callable(getattr(obj, name, None))]
    for name in wrapped:
        setattr(obj, name, _timed(getattr(obj, name), clock))
    try:
        yield
    finally:
        for name in wrapped:
            delattr(obj, name)


def _timed(method: Callable, clock: CallClock) -> Callable:
    def call(*args: object, **kwargs: object) -> object:
        clock.depth += 1
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            clock.depth -= 1
            if clock.depth == 0:
                clock.seconds += time.perf_counter() - started

    return call


@dataclass(frozen=True)
class RoundOverhead:
    """Per-round times of real generations, in milliseconds: means over all rounds of all
    repeats, and the median round's overhead (robust to the scheduler's pauses on a
    shared machine, which land in whatever code runs)."""

    drafter: str  # "none" for plain decoding
    sampling: str  # "greedy" or e.g. "T=0.8, top-p=0.95"
    rounds: float  # rounds per generation
    tokens_per_round: float
    round_ms: float  # wall time of a round
    target_ms: float  # inside the target's forwards
    draft_ms: float  # inside the drafter's propose / observe
    overhead_mean_ms: float  # round - target - draft: sampling, verification, bookkeeping
    overhead_ms: float  # the median round's overhead

    def to_dict(self, step_ms: float | None = None) -> dict[str, object]:
        out: dict[str, object] = dict(self.__dict__)
        if step_ms:
            out["overhead_share_of_step"] = self.overhead_ms / step_ms
        return out


def sampling_label(params: SamplingParams) -> str:
    if params.greedy:
        return "greedy"
    label = f"T={params.temperature:g}"
    if params.top_k:
        label += f", top-k={params.top_k}"
    if params.top_p < 1:
        label += f", top-p={params.top_p:g}"
    return label


@dataclass(frozen=True)
class TimedRound:
    """One round: wall, target and drafter seconds, and the tokens it emitted."""

    wall: float
    target: float
    draft: float
    tokens: int

    @property
    def overhead(self) -> float:
        return self.wall - self.target - self.draft


def round_overheads(
    target: CausalLM,
    drafters: dict[str, Drafter | None],
    prompt: Sequence[int],
    settings: Sequence[SamplingParams],
    tokens: int = 64,
    gamma: int = 3,
    repeats: int = 3,
) -> list[RoundOverhead]:
    """For each drafter (None: plain decoding) and sampling setting, generate ``tokens``
    tokens after ``prompt`` ``repeats`` times (all configurations interleaved, seeds
    0..repeats-1) and split each round's wall time into target forwards, drafter calls and
    the overhead around them."""
    samples: dict[tuple[str, int], list[TimedRound]] = {}
    for repeat in range(repeats):
        for name, drafter in drafters.items():
            for index, params in enumerate(settings):
                samples.setdefault((name, index), []).extend(
                    _timed_rounds(target, drafter, prompt, params, tokens, gamma, repeat)
                )
    out = []
    for (name, index), rounds in samples.items():
        if not rounds:
            raise ValueError("the generations ended after one round: ask for more tokens")
        n = len(rounds)
        wall, target_s, draft_s = (sum(getattr(r, f) for r in rounds) / n for f in TIMES)
        out.append(
            RoundOverhead(
                drafter=name,
                sampling=sampling_label(settings[index]),
                rounds=n / repeats,
                tokens_per_round=sum(r.tokens for r in rounds) / n,
                round_ms=wall * 1e3,
                target_ms=target_s * 1e3,
                draft_ms=draft_s * 1e3,
                overhead_mean_ms=(wall - target_s - draft_s) * 1e3,
                overhead_ms=statistics.median(r.overhead for r in rounds) * 1e3,
            )
        )
    return out


TIMES = ("wall", "target", "draft")


def _timed_rounds(
    target: CausalLM,
    drafter: Drafter | None,
    prompt: Sequence[int],
    params: SamplingParams,
    tokens: int,
    gamma: int,
    seed: int,
) -> list[TimedRound]:
    """The rounds of one generation after its first (the prefill's) round."""
    engine = SpeculativeEngine(target, drafter, gamma)
    target_clock, draft_clock = CallClock(), CallClock()
    stop = StopCriteria(max_new_tokens=tokens)
    generator = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode(), timed_calls(target, TARGET_CALLS, target_clock):
        stream = engine.stream(prompt, params, stop, generator)
        next(stream)  # the prefill and the first round: not timed
        with timed_calls(drafter, DRAFTER_CALLS, draft_clock):
            while True:
                before = (time.perf_counter(), target_clock.seconds, draft_clock.seconds)
                round_ = next(stream, None)
                if round_ is None:
                    break
                after = (time.perf_counter(), target_clock.seconds, draft_clock.seconds)
                spent = [b - a for a, b in zip(before, after, strict=True)]
                out.append(TimedRound(*spent, tokens=len(round_.tokens)))
    target.reset()
    return out
