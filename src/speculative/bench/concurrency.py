"""`speculative bench --concurrency 1 2 4 8 16`: batched decoding at several batch sizes.

For every batch size B, the same N prompts of the suite (categories interleaved; N the
largest B) are decoded by :class:`~speculative.engine.batch.BatchEngine` in consecutive
closed batches of B rows (every row of a batch starts together and emits the same token
budget, greedy, no EOS), so every B decodes the same work: at B = 1 that is N single
generations one after another, not one prompt. Three setups run side by side on the
same prompts:

- ``plain``: plain batched decoding (every row γ = 0);
- ``γ=G``: speculation with the drafter at a fixed γ;
- ``load-aware``: :class:`~speculative.engine.gamma.LoadAwareGamma` picks every row's γ
  (at most ``max_gamma``) each round from the pass-cost model the engine and the server
  use, T(r, n) = K(n) + R(r) − K(r) (K: n tokens in one row, R: r rows of one token,
  both measured here once per runtime, then corrected by the passes each run makes),
  each row's running acceptance per position and the drafter's measured cost; as the
  batch is closed (nothing waits to join, ``BatchEngine.draining``), only the rows
  furthest from their end may draft;

and, where transformers can load the target, its padded batched ``generate()`` as a peer.
Setups are interleaved batch by batch (each closed batch runs under every setup, in a
rotated order, before the next starts: drift on a shared machine hits all alike); each
cell is the median of its repeats, and its ×plain the median over the repeats of its
ratio to plain decoding in the same repeat. The pass that prefills every prompt is
excluded (tokens and time); the peer's prefill is taken out as ``t(N tokens) −
t(1 token)``. Reported per cell: aggregate tokens/s, per-request tokens/s (each row's
tokens ÷ the time until it finished), the mean γ chosen per round, target passes, the
share of decode time spent inside the target pass (the rest is drafting and Python
overhead), what bounds the passes and how much of the decode time their floors explain
(on the C kernels: each pass's bytes at the measured read bandwidth and its multiply-adds
at the measured peaks, :func:`~speculative.models.native.profile.pass_floors`; the larger
is the pass's floor), and whether the outputs equal plain decoding's token for token.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from speculative.bench.prompts import BenchPrompt
from speculative.bench.runner import kv_cache_of
from speculative.capabilities import provides
from speculative.drafters.registry import build_drafter
from speculative.engine import BatchEngine, BatchRequest, LoadAwareGamma, StopCriteria
from speculative.engine.batch import PassShape
from speculative.engine.costs import PassCostCurves, pass_cost_curves, rows_verify_cost
from speculative.engine.gamma import LOAD_AWARE_MAX_GAMMA
from speculative.models.base import PadsBatchRows, SupportsBatchRows, SupportsKernels
from speculative.models.native.profile import (
    MachinePeaks,
    PassFloors,
    measure_peaks,
    pass_floors,
)
from speculative.sampling import SamplingParams
from speculative.targets import LoadedModel, encode_prompt, load_target

Loader = Callable[..., LoadedModel]  # (target, runtime, precision, kv_cache=)
FloorsOf = Callable[[Sequence[tuple[int, int]]], PassFloors]  # a pass's rows -> its floors
GREEDY = SamplingParams(temperature=0.0)
PLAIN, PEER = "plain", "transformers/generate"
CURVE_POINTS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class ConcurrencySettings:
    """What the concurrency bench runs."""

    target: str = "default"
    runtimes: tuple[str, ...] = ("native",)
    precision: str = "auto"
    kv_cache: str = "auto"  # the native runtime's KV cache (see load_target)
    drafter: str = "ngram"
    gamma: int = 4
    max_gamma: int = LOAD_AWARE_MAX_GAMMA  # load-aware: a row's own cap
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_new_tokens: int = 32
    repeats: int = 1
    peers: bool = True
    chat: bool | None = None
    progress: bool = True
    curve_repeats: int = 3
    clock: str = "wall"  # "cpu": process CPU time (steadier on a shared machine, 1 thread)
    roofline: bool = True  # measure the machine's peaks and each pass's floors (C kernels)


@dataclass
class Roofline:
    """Sums over a run's decode passes: their memory and compute floors, the larger of
    the two per pass, and the wall time of the decode they are read against."""

    memory_seconds: float = 0.0
    compute_seconds: float = 0.0
    floor_seconds: float = 0.0
    wall_seconds: float = 0.0

    @staticmethod
    def of(passes: Sequence[PassShape], floors_of: FloorsOf, wall: float) -> Roofline:
        totals = Roofline(wall_seconds=wall)
        for shape in passes:
            floors = floors_of(shape.rows)
            totals.memory_seconds += floors.memory_ms / 1e3
            totals.compute_seconds += floors.compute_ms / 1e3
            totals.floor_seconds += floors.floor_ms / 1e3
        return totals

    def plus(self, other: Roofline) -> Roofline:
        return Roofline(
            self.memory_seconds + other.memory_seconds,
            self.compute_seconds + other.compute_seconds,
            self.floor_seconds + other.floor_seconds,
            self.wall_seconds + other.wall_seconds,
        )

    @property
    def binds(self) -> str:
        """Which floor is the larger over the whole run."""
        return "memory" if self.memory_seconds >= self.compute_seconds else "compute"

    @property
    def share(self) -> float | None:
        """The floors' share of the decode's wall time: 1 would be every pass at its floor
        and nothing outside the passes."""
        return self.floor_seconds / self.wall_seconds if self.wall_seconds > 0 else None


@dataclass
class Cell:
    """One setup at one batch size (medians over the repeats)."""

    runtime: str
    setup: str
    batch: int
    new_tokens: int
    seconds: float
    tokens_per_second: float
    per_request_tokens_per_second: float
    mean_gamma: float | None
    passes: int | None
    forward_share: float | None  # decode time inside the target pass
    identical: bool | None  # outputs equal plain decoding's (None: not compared)
    vs_plain: float | None = None
    vs_plain_b1: float | None = None
    binds: str | None = None  # the passes' larger floor over the run: memory or compute
    roofline_share: float | None = None  # the passes' floors ÷ the decode's wall time


@dataclass
class ConcurrencyRun:
    settings: ConcurrencySettings
    cells: list[Cell]
    verify_cost: dict[str, dict[int, float]]  # runtime -> T(n)/T(1) of an 8-row pass
    prompt_tokens: list[int]
    notes: list[str] = field(default_factory=list)
    pass_costs: dict[str, PassCostCurves] = field(default_factory=dict)  # the policy's


@dataclass
class _Record:
    tokens: list[list[int]]
    new_tokens: int
    seconds: float
    per_request: float
    mean_gamma: float | None = None
    passes: int | None = None
    forward_share: float | None = None  # wall time inside the target pass ÷ wall time
    rounds: int = 0  # row rounds behind mean_gamma
    roofline: Roofline | None = None  # the decode passes' floors (C kernels only)


def in_batches(
    run: Callable[[Sequence[list[int]]], _Record], prompts: Sequence[list[int]], batch: int
) -> _Record:
    """``run`` over consecutive closed batches of ``batch`` prompts (the last may be
    smaller), merged into one record: tokens and seconds summed, per-request tokens/s
    averaged over the requests, mean γ over the rounds, the forward share over the time."""
    return merged([run(chunk) for chunk in chunks(prompts, batch)])


def chunks(prompts: Sequence[list[int]], batch: int) -> list[Sequence[list[int]]]:
    """Consecutive closed batches of ``batch`` prompts (the last may be smaller)."""
    return [prompts[i : i + batch] for i in range(0, len(prompts), batch)]


def merged(parts: list[_Record]) -> _Record:
    """Closed batches' records as one (see :func:`in_batches`)."""
    requests = [len(part.tokens) for part in parts]
    seconds = sum(part.seconds for part in parts)
    gammas = [part for part in parts if part.mean_gamma is not None]
    rounds = sum(part.rounds for part in gammas)
    timed = [part for part in parts if part.forward_share is not None]
    forward = sum(part.forward_share * part.seconds for part in timed)  # type: ignore[operator]
    return _Record(
        tokens=[tokens for part in parts for tokens in part.tokens],
        new_tokens=sum(part.new_tokens for part in parts),
        seconds=seconds,
        per_request=sum(p.per_request * n for p, n in zip(parts, requests, strict=True))
        / sum(requests),
        mean_gamma=_mean_gamma(gammas, rounds),
        passes=sum(part.passes or 0 for part in parts) if parts[0].passes is not None else None,
        forward_share=forward / seconds if timed and seconds > 0 else None,
        rounds=rounds,
        roofline=_summed_roofline(parts),
    )


def _summed_roofline(parts: list[_Record]) -> Roofline | None:
    """The parts' floors and wall times summed (None unless every part has them)."""
    rooflines = [part.roofline for part in parts if part.roofline is not None]
    if not parts or len(rooflines) < len(parts):
        return None
    total = Roofline()
    for roofline in rooflines:
        total = total.plus(roofline)
    return total


def _mean_gamma(parts: list[_Record], rounds: int) -> float | None:
    """The parts' mean γ over all their rounds (0 when they drafted in none)."""
    if not parts:
        return None
    if not rounds:
        return 0.0
    return sum(p.mean_gamma * p.rounds for p in parts) / rounds  # type: ignore[operator]


# --------------------------------------------------------------------------- our engine


def run_engine_batch(
    target: LoadedModel,
    prompts: Sequence[list[int]],
    drafter: str | None,
    gamma: int,
    load: LoadAwareGamma | None,
    max_new_tokens: int,
    clock: Callable[[], float] = time.perf_counter,
    floors_of: FloorsOf | None = None,
) -> _Record:
    """One closed batch to completion; the prefill pass is excluded from tokens and time.
    ``clock`` times the batch (the share in the target pass is always wall time);
    ``floors_of`` prices its decode passes' floors (the record's roofline)."""
    engine = BatchEngine(target.lm, max_batch=len(prompts), load=load)
    engine.draining = True  # a closed batch: nothing joins, its end is its last row's
    stop = StopCriteria(max_new_tokens=max_new_tokens)  # no EOS: every row emits the budget
    for ids in prompts:
        row_drafter = build_drafter(drafter, target) if gamma and drafter else None
        engine.add(BatchRequest(ids, GREEDY, stop, torch.Generator(), row_drafter, gamma))
    engine.step()  # the prefill pass (prompts of one token already decode in it)
    before = sum(len(row.state.generated) for row in engine.rows.values())
    before += sum(len(result.token_ids) for result in engine.finished.values())
    forward_before, passes_before = engine.forward_seconds, engine.target_passes
    engine.pass_log = [] if floors_of is not None else None
    started, wall, finished_at = clock(), time.perf_counter(), {}
    while engine.rows:
        for row_id, round_ in engine.step().items():
            if round_.finished:
                finished_at[row_id] = clock() - started
    seconds, wall = clock() - started, time.perf_counter() - wall
    results = [engine.finished[i] for i in sorted(engine.finished)]
    per_request = [
        len(r.token_ids) / finished_at[i] for i, r in enumerate(results) if finished_at.get(i)
    ]
    gammas = [g for r in results for g in r.stats.gammas]
    return _Record(
        tokens=[r.token_ids for r in results],
        new_tokens=sum(len(r.token_ids) for r in results) - before,
        seconds=seconds,
        per_request=statistics.mean(per_request) if per_request else 0.0,
        mean_gamma=statistics.mean(gammas) if gammas else 0.0,
        passes=engine.target_passes - passes_before,
        forward_share=(engine.forward_seconds - forward_before) / wall if wall > 0 else None,
        rounds=len(gammas),
        roofline=None
        if floors_of is None or engine.pass_log is None
        else Roofline.of(engine.pass_log, floors_of, wall),
    )


# --------------------------------------------------------------------------- transformers


def transformers_batch(
    model: Any,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    pad_id: int,
    clock: Callable[[], float] = time.perf_counter,
) -> _Record:
    """transformers' padded batched ``generate()`` (left padding, greedy, exactly
    ``max_new_tokens`` each): decode time = t(N tokens) − t(1 token)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, n]
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, n]
    for b, ids in enumerate(prompts):
        input_ids[b, width - len(ids) :] = torch.tensor(ids)
        mask[b, width - len(ids) :] = 1

    def generate(tokens: int) -> tuple[torch.Tensor, float]:
        started = clock()
        with torch.inference_mode():
            output = model.generate(
                input_ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=False, pad_token_id=pad_id,
            )  # fmt: skip
        return output[:, width:], clock() - started

    _, first = generate(1)
    output, total = generate(max_new_tokens)
    seconds = max(total - first, 1e-9)
    new = len(prompts) * (max_new_tokens - 1)
    return _Record(
        tokens=output.tolist(),
        new_tokens=new,
        seconds=seconds,
        per_request=new / len(prompts) / seconds,
    )


def _peer_model(settings: ConcurrencySettings, setups: dict[str, LoadedModel], loader: Loader):
    """The transformers model of the target (an hf runtime's, else loaded for the peer)."""
    from speculative.bench.methods import transformers_model

    for target in setups.values():
        model = transformers_model(target.lm)
        if model is not None:
            return model
    try:
        return transformers_model(loader(settings.target, "hf", "auto").lm)
    except (ValueError, OSError, ImportError) as exc:
        print(f"bench: no transformers peer: {exc}", file=sys.stderr)
        return None


# --------------------------------------------------------------------------- the run


def batch_prompts(
    target: LoadedModel, prompts: Sequence[BenchPrompt], chat: bool | None, size: int
) -> list[list[int]]:
    """``size`` prompts, categories interleaved (the suite cycled if it is shorter)."""
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    mixed = [p for group in zip(*by_category.values(), strict=False) for p in group]
    mixed += [p for p in prompts if p not in mixed]
    chosen = [mixed[i % len(mixed)] for i in range(size)]
    return [encode_prompt(target.tokenizer, p.prompt, p.messages, chat) for p in chosen]


def run_concurrency(
    settings: ConcurrencySettings, prompts: Sequence[BenchPrompt], loader: Loader = load_target
) -> ConcurrencyRun:
    if not prompts:
        raise ValueError("no prompts to run")
    if min(settings.concurrency) < 1:
        raise ValueError("concurrency levels must be >= 1")
    kv_cache = kv_cache_of(settings.kv_cache)
    loaded = [
        loader(settings.target, rt, settings.precision, **kv_cache) for rt in settings.runtimes
    ]
    setups = {target.runtime: target for target in loaded}  # "auto" named as resolved
    for runtime, target in setups.items():
        if not isinstance(target.lm, SupportsBatchRows):
            raise ValueError(f"the {runtime} runtime cannot hold several sequences")
    if settings.clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {settings.clock!r}")
    clock = CLOCKS[settings.clock]
    largest = max(settings.concurrency)
    ids = {rt: batch_prompts(t, prompts, settings.chat, largest) for rt, t in setups.items()}
    curves, pass_costs = {}, {}
    for runtime, target in setups.items():
        context = ids[runtime][0][:64]
        model: Any = target.lm  # SupportsBatchRows, checked above
        repeats = settings.curve_repeats
        curves[runtime] = rows_verify_cost(  # the report's
            model, context, CURVE_POINTS, repeats, _report_rows(model), clock
        )
        pass_costs[runtime] = pass_cost_curves(  # the load-aware policy's
            model, context, largest, CURVE_POINTS[-1], repeats, clock
        )
    floors = {rt: kernel_floors(t) if settings.roofline else None for rt, t in setups.items()}
    peer = _peer_model(settings, setups, loader) if settings.peers else None
    pad = min(next(iter(setups.values())).eos_token_ids, default=0)
    labels = [PLAIN, f"{settings.drafter} γ={settings.gamma}", f"{settings.drafter} load-aware"]
    total = len(settings.concurrency) * settings.repeats * len(setups) * (len(labels) + bool(peer))
    bar = tqdm(
        total=total, desc="bench --concurrency", disable=not settings.progress, file=sys.stderr
    )
    by_batch: dict[int, dict[tuple[str, str], list[_Record]]] = {
        batch: {} for batch in settings.concurrency
    }
    for repeat in range(settings.repeats):
        # every batch size once per repeat, the order reversed every other repeat: B = 1
        # and B = 8 run a minute apart, not a whole sweep apart, and a machine whose speed
        # drifts (or jumps, as a shared one does) weighs on every B alike
        sizes = settings.concurrency if repeat % 2 == 0 else settings.concurrency[::-1]
        for batch in sizes:
            records = by_batch[batch]
            for runtime, target in setups.items():  # setups interleaved: drift hits all alike
                configs = [
                    (PLAIN, 0, None),
                    (labels[1], settings.gamma, None),
                    (labels[2], settings.max_gamma, _load_aware(pass_costs[runtime])),
                ]
                # every closed batch runs under every setup before the next batch starts
                # (each batch's order rotated): a setup and plain decoding run seconds
                # apart, not a whole sweep over the prompts apart
                parts: dict[str, list[_Record]] = {label: [] for label, _, _ in configs}
                for index, chunk in enumerate(chunks(ids[runtime], batch)):
                    for label, gamma, load in rotated(configs, repeat + index):
                        parts[label].append(
                            run_engine_batch(target, chunk, settings.drafter, gamma, load,
                                             settings.max_new_tokens, clock, floors[runtime])
                        )  # fmt: skip
                for label, _, _ in configs:
                    records.setdefault((runtime, label), []).append(merged(parts[label]))
                    bar.update()
            if peer is not None:
                runtime = next(iter(setups))
                record = in_batches(
                    lambda chunk: transformers_batch(peer, chunk, settings.max_new_tokens, pad),
                    ids[runtime], batch,
                )  # fmt: skip
                records.setdefault(("hf", PEER), []).append(record)
                bar.update()
    cells: list[Cell] = []
    for batch in settings.concurrency:
        cells.extend(_cells(batch, by_batch[batch]))
    bar.close()
    _add_ratios(cells)
    prompt_tokens = [len(p) for p in next(iter(ids.values()))]
    notes = [
        f"every B decodes the same {len(prompt_tokens)} prompts in consecutive closed batches "
        "of B: the rows of a batch start together, greedy, exactly max_new_tokens each (no "
        "EOS); each batch's prefill pass is excluded",
        f"clock: {settings.clock} ({'process CPU time' if settings.clock == 'cpu' else 'wall'}"
        f"); torch threads: {torch.get_num_threads()}; 'in forward': wall time inside the "
        "target pass ÷ wall time of the decode steps (the rest: drafting and Python)",
    ]
    priced = {rt: f for rt, f in floors.items() if f is not None}
    if priced:
        notes.append(ROOFLINE_NOTE)
        notes += [f"{rt}: {f.describe()}" for rt, f in priced.items()]
    return ConcurrencyRun(settings, cells, curves, prompt_tokens, notes, pass_costs)


@dataclass(frozen=True)
class KernelFloors:
    """Prices a pass of a C-kernels model at its floors (:func:`pass_floors`)."""

    work: dict[str, int]  # the decoder's per-token work (``SupportsKernels.kernel_work``)
    peaks: MachinePeaks

    def __call__(self, rows: Sequence[tuple[int, int]]) -> PassFloors:
        return pass_floors(self.work, self.peaks, rows)

    def describe(self) -> str:
        p = self.peaks
        return (
            f"peaks measured by the kernels' microbenchmarks ({p.isa}, {p.threads} threads): "
            f"read {p.read_gbps:.1f} GB/s, fp32 FMA {p.fma_macs_per_s / 1e9:.0f} GMAC/s, "
            f"int8 dot {p.int8_macs_per_s / 1e9:.0f} GMAC/s"
        )


def kernel_floors(target: LoadedModel) -> KernelFloors | None:
    """``target``'s pass pricer, the machine's peaks measured once here with the kernels'
    own instructions; None for a model not running on the C kernels."""
    lm = target.lm
    if not provides(lm, SupportsKernels):
        return None
    library, work = lm.kernel_library(), lm.kernel_work()
    if library is None or work is None:
        return None
    return KernelFloors(work, measure_peaks(library, torch.get_num_threads()))


def _load_aware(costs: PassCostCurves) -> LoadAwareGamma:
    return LoadAwareGamma(costs.tokens, rows_cost=costs.rows)


def _report_rows(model: Any) -> int:
    """The sequences the report's pass of n tokens is spread over: 8 (about n / 8 tokens
    each, a round's shape at B = 8), or 1 on a runtime that pads every row to the longest
    (n = the positions computed)."""
    return 1 if isinstance(model, PadsBatchRows) else 8


def rotated(items: Sequence[Any], repeat: int) -> list[Any]:
    """``items`` starting at position ``repeat`` (mod its length): over as many repeats as
    setups, every setup runs once in every position of the sequence, so a cost that
    depends on the position (what ran just before, a garbage collection, the machine's
    drift within a repeat) is not charged to one setup."""
    shift = repeat % len(items)
    return [*items[shift:], *items[:shift]]


def _cells(batch: int, records: dict[tuple[str, str], list[_Record]]) -> list[Cell]:
    first = next((rt for rt, label in records if label == PLAIN), None)
    cells = []
    for (runtime, label), runs in records.items():
        plain = records.get((runtime, PLAIN), records.get((first, PLAIN)))
        mid = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
        seconds = statistics.median(r.seconds for r in runs)
        identical = None
        if label != PEER and plain is not None:
            identical = all(r.tokens == plain[0].tokens for r in runs)
        forward = mid.forward_share
        roofline = _summed_roofline(runs)
        cells.append(
            Cell(
                runtime=runtime,
                setup=label,
                batch=batch,
                new_tokens=mid.new_tokens,
                seconds=seconds,
                tokens_per_second=mid.new_tokens / seconds if seconds > 0 else 0.0,
                per_request_tokens_per_second=_per_request(label, batch, runs, seconds),
                mean_gamma=mid.mean_gamma,
                passes=mid.passes,
                forward_share=forward,
                identical=identical,
                vs_plain=_paired_ratio(runs, plain),
                binds=None if roofline is None else roofline.binds,
                roofline_share=None if roofline is None else roofline.share,
            )
        )
    return cells


def _paired_ratio(runs: list[_Record], plain: list[_Record] | None) -> float | None:
    """×plain: the median over the repeats of a run's tokens/s ÷ plain decoding's in the
    same repeat (the two ran interleaved, so the machine's drift between repeats
    cancels), rather than a ratio of medians taken from different repeats."""
    if not plain or len(plain) != len(runs):
        return None
    ratios = [
        (run.new_tokens / run.seconds) / (base.new_tokens / base.seconds)
        for run, base in zip(runs, plain, strict=True)
        if run.seconds > 0 and base.seconds > 0 and base.new_tokens > 0
    ]
    return statistics.median(ratios) if ratios else None


def _per_request(label: str, batch: int, runs: list[_Record], seconds: float) -> float:
    """Median per-request tokens/s; the peer's rows all finish together: its aggregate ÷ B."""
    if label == PEER:
        return runs[0].new_tokens / batch / seconds if seconds > 0 else 0.0
    return statistics.median(r.per_request for r in runs)


def _add_ratios(cells: list[Cell]) -> None:
    """×plain at the smallest B (same runtime; the peer against the first runtime's
    plain): a ratio of medians, as different batch sizes ran at different times (×plain
    at the same B is :func:`_paired_ratio`'s)."""
    plain = {(c.runtime, c.batch): c.tokens_per_second for c in cells if c.setup == PLAIN}
    runtimes = [c.runtime for c in cells if c.setup == PLAIN]
    smallest = min((c.batch for c in cells), default=1)
    for cell in cells:
        runtime = cell.runtime if (cell.runtime, cell.batch) in plain else runtimes[0]
        first = plain.get((runtime, smallest))
        cell.vs_plain_b1 = cell.tokens_per_second / first if first else None


# --------------------------------------------------------------------------- reports

HEADER = (
    "runtime", "setup", "B", "tok/s", "×plain", "×plain B=1", "per-request tok/s",
    "mean γ", "passes", "in forward", "binds", "floors", "identical",
)  # fmt: skip
ROOFLINE_NOTE = (
    "binds: the larger of the decode passes' floors over the run (memory: weights and KV "
    "cache read once per pass at the measured bandwidth; compute: multiply-adds at the "
    "measured fp32 and int8-dot peaks); floors: their sum, the larger per pass, ÷ the "
    "decode's wall time (the rest is the passes above their floors, drafting and Python)"
)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table_rows(run: ConcurrencyRun) -> list[list[str]]:
    order = sorted(run.cells, key=lambda c: (c.batch, c.setup == PEER))
    return [_cell_text(c) for c in order]


def _cell_text(c: Cell) -> list[str]:
    return [
        c.runtime,
        c.setup,
        str(c.batch),
        _fmt(c.tokens_per_second, ".1f"),
        _fmt(c.vs_plain),
        _fmt(c.vs_plain_b1),
        _fmt(c.per_request_tokens_per_second, ".1f"),
        _fmt(c.mean_gamma),
        "-" if c.passes is None else str(c.passes),
        _fmt(c.forward_share, ".0%"),
        c.binds or "-",
        _fmt(c.roofline_share, ".0%"),
        {None: "-", True: "yes", False: "NO"}[c.identical],
    ]


def concurrency_terminal(run: ConcurrencyRun) -> str:
    from speculative.bench.report import text_table

    lines = [text_table(HEADER, table_rows(run))]
    for runtime, curve in run.verify_cost.items():
        points = ", ".join(f"{n}: {v:.2f}" for n, v in curve.items())
        lines.append(f"{runtime}: T(n)/T(1) of one pass of n tokens over 8 rows: {points}")
    for runtime, costs in run.pass_costs.items():
        for name, curve in _model_curves(costs):
            points = ", ".join(f"{n}: {v:.2f}" for n, v in curve.items())
            lines.append(f"{runtime}: {name}: {points}")
    lines += [f"- {note}" for note in run.notes]
    return "\n".join(lines)


def _model_curves(costs: PassCostCurves) -> list[tuple[str, dict[int, float]]]:
    return [
        ("K(n)/T(1), n tokens in one row", costs.tokens),
        ("R(r)/T(1), r rows of one token", costs.rows),
    ]


def concurrency_markdown(run: ConcurrencyRun) -> str:
    from speculative.bench.report import markdown_table

    s = run.settings
    lines = [
        "# Batched decoding by concurrency",
        "",
        f"Target `{s.target}` ({s.precision}), runtimes {', '.join(s.runtimes)}, drafter "
        f"`{s.drafter}`, fixed γ = {s.gamma}, load-aware γ ≤ {s.max_gamma}, "
        f"{s.max_new_tokens} new tokens per row, {s.repeats} repeat(s), greedy.",
        "",
        markdown_table(HEADER, table_rows(run)),
        "",
        "T(n)/T(1) of one pass of n tokens over 8 rows:",
        "",
    ]
    for runtime, curve in run.verify_cost.items():
        header = ["runtime", *map(str, curve)]
        lines.append(markdown_table(header, [[runtime, *(f"{v:.2f}" for v in curve.values())]]))
        lines.append("")
    if run.pass_costs:
        lines += [
            "The load-aware policy's pass-cost model, T(r, n) = K(n) + R(r) − K(r):",
            "",
        ]
    for runtime, costs in run.pass_costs.items():
        for name, curve in _model_curves(costs):
            header = [f"{runtime}: {name}", *map(str, curve)]
            lines.append(markdown_table(header, [["", *(f"{v:.2f}" for v in curve.values())]]))
            lines.append("")
    lines += [f"- {note}" for note in run.notes]
    return "\n".join(lines) + "\n"


def concurrency_payload(run: ConcurrencyRun) -> dict[str, Any]:
    return {
        "mode": "concurrency",
        "settings": asdict(run.settings),
        "cells": [asdict(c) for c in run.cells],
        "verify_cost": {rt: {str(n): v for n, v in c.items()} for rt, c in run.verify_cost.items()},
        "pass_costs": {rt: c.to_dict() for rt, c in run.pass_costs.items()},
        "prompt_tokens": run.prompt_tokens,
        "notes": run.notes,
    }


def write_concurrency(run: ConcurrencyRun, folder: Path) -> list[Path]:
    """concurrency.json and concurrency.md in ``folder``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / "concurrency.json", folder / "concurrency.md"
    json_path.write_text(json.dumps(concurrency_payload(run), indent=2) + "\n")
    md_path.write_text(concurrency_markdown(run))
    return [json_path, md_path]
