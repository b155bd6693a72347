"""The exactness grid: drafters × modes × sampling settings, one check per cell, and its
markdown table (docs/exactness.md)."""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any

from speculative.exactness.runner import (
    CheckConfig,
    CheckReport,
    ControlTooWeak,
    SharedDraws,
    run_check,
)

# (label, temperature, top_k, top_p)
SAMPLINGS: tuple[tuple[str, float, int, float], ...] = (
    ("greedy", 0.0, 0, 1.0),
    ("T=1", 1.0, 0, 1.0),
    ("T=0.7 top-k=5", 0.7, 5, 1.0),
    ("T=0.7 top-p=0.9", 0.7, 0, 0.9),
)
GRID_MODES = ("chain", "tree-static", "batch")


@dataclass(frozen=True)
class Drafter:
    """A drafter of the grid: its label, registry name and the runtime it runs on."""

    label: str
    spec: str
    runtime: str


def tiny_drafters(folder: Path) -> list[Drafter]:
    """Every registry drafter on the tiny fixture's native runtime (heads: the fixture's
    random heads), and the transformers runtime under n-gram drafting: its target passes,
    tree masks, cache compaction and padded batch rows, without one transformers draft
    forward per row and draft token."""
    return [
        Drafter("ngram", "ngram", "native"),
        Drafter("self-int4", "self-int4", "native"),
        Drafter("self-exit:1", "self-exit:1", "native"),
        Drafter("eagle", f"eagle:{folder / 'eagle'}", "native"),
        Drafter("medusa", f"medusa:{folder / 'medusa'}", "native"),
        Drafter("auto", f"auto:{folder / 'eagle'}", "native"),
        Drafter("ngram", "ngram", "hf"),
    ]


def default_drafters() -> list[Drafter]:
    """The registry's drafters on the default (int4) model: self-int4/int8/bf16 cannot be
    cheaper than an int4 target (the registry refuses them); the transformers runtime
    under n-gram drafting."""
    return [
        Drafter("ngram", "ngram", "native"),
        Drafter("self-exit:15", "self-exit:15", "native"),
        Drafter("eagle", "eagle", "native"),
        Drafter("medusa", "medusa", "native"),
        Drafter("auto", "auto", "native"),
        Drafter("ngram", "ngram", "hf"),
    ]


DEFAULT_SAMPLINGS = SAMPLINGS[:2]  # greedy and T = 1: the default model's grid is smaller


@dataclass
class Cell:
    drafter: Drafter
    mode: str
    sampling: str
    seconds: float
    report: CheckReport | None = None
    problem: str | None = None  # "n/a: ..." (unsupported) or "control not detected: ..."

    @property
    def ok(self) -> bool:
        """Exact with its control detected, or not applicable."""
        if self.report is None:
            return self.problem is not None and self.problem.startswith("n/a")
        return self.report.exact and self.report.control_detected

    def to_dict(self) -> dict[str, Any]:
        return {
            "drafter": self.drafter.label,
            "runtime": self.drafter.runtime,
            "mode": self.mode,
            "sampling": self.sampling,
            "seconds": self.seconds,
            "problem": self.problem,
            "report": None if self.report is None else self.report.to_dict(),
        }


Loader = Callable[[str], Any]  # runtime -> a loaded target (picklable for jobs > 1)


@dataclass(frozen=True)
class PlannedCell:
    """One cell of the grid before it runs: where it sits, what it checks."""

    index: int
    drafter: Drafter
    label: str
    config: CheckConfig


def plan_matrix(
    drafters: Sequence[Drafter],
    base: CheckConfig,
    modes: Sequence[str] = GRID_MODES,
    samplings: Sequence[tuple[str, float, int, float]] = SAMPLINGS,
) -> list[PlannedCell]:
    """The grid's cells in table order: drafter, then mode, then sampling setting."""
    cells = []
    for drafter in drafters:
        for mode in modes:
            for label, temperature, top_k, top_p in samplings:
                config = replace(
                    base, drafter=drafter.spec, mode=mode, temperature=temperature,
                    top_k=top_k, top_p=top_p,
                )  # fmt: skip
                cells.append(PlannedCell(len(cells), drafter, label, config))
    return cells


def run_matrix(
    targets: Loader,
    drafters: Sequence[Drafter],
    prompts: Sequence[Sequence[int]],
    base: CheckConfig,
    modes: Sequence[str] = GRID_MODES,
    samplings: Sequence[tuple[str, float, int, float]] = SAMPLINGS,
    on_cell: Callable[[Cell], None] = lambda cell: None,
    jobs: int = 1,
) -> list[Cell]:
    """One check per (drafter, mode, sampling), in table order; ``targets(runtime)`` loads
    the target for a runtime (once per runtime and process).

    ``jobs`` > 1 runs the cells in that many worker processes (spawned, one thread each;
    ``targets`` must then be picklable, e.g. a ``functools.partial`` of a module-level
    loader). Every continuation's generator is seeded from the cell's configuration alone,
    so the cells' results do not depend on ``jobs`` (only their seconds do); ``auto``'s
    cells excepted, whose choices read the clock, so that their draws vary from run to
    run."""
    planned = plan_matrix(drafters, base, modes, samplings)
    if jobs <= 1:
        loaded: dict[str, Any] = {}
        shared = {_task(c): SharedDraws() for c in planned}
        return [
            _announce(_run_planned(targets, loaded, c, prompts, shared[_task(c)]), on_cell)
            for c in planned
        ]
    done: dict[int, Cell] = {}
    context = multiprocessing.get_context("spawn")
    with _pool(jobs, context) as pool, _manager(context) as manager:
        finished = manager.Queue()  # each cell as it ends (a task holds several)
        futures = [
            pool.submit(run_cells, targets, group, prompts, finished)
            for group in sorted(_groups(planned), key=_expected_cost, reverse=True)
        ]
        while len(done) < len(planned):
            try:
                index, cell = finished.get(timeout=1.0)
            except queue.Empty:
                _raise_from_workers(futures)
                continue
            done[index] = _announce(cell, on_cell)
        _raise_from_workers(futures)
    return [done[c.index] for c in planned]


def run_cells(
    targets: Loader,
    cells: Sequence[PlannedCell],
    prompts: Sequence[Sequence[int]],
    finished: Any = None,
) -> list[tuple[int, Cell]]:
    """Run planned cells one after another (a worker's task), each runtime's target
    loaded once and batched samples shared among them (:class:`SharedDraws`); (index,
    cell) pairs, each also put on ``finished`` (a queue) as soon as it ends."""
    loaded: dict[str, Any] = {}
    shared = SharedDraws()
    out = []
    for c in cells:
        out.append((c.index, _run_planned(targets, loaded, c, prompts, shared)))
        if finished is not None:
            finished.put(out[-1])
    return out


def _raise_from_workers(futures: Sequence[Future]) -> None:
    """A worker's exception, raised here (the cells it did not finish never arrive)."""
    for future in futures:
        error = future.exception() if future.done() else None
        if error is not None:
            raise error


def _run_planned(
    targets: Loader,
    loaded: dict[str, Any],
    c: PlannedCell,
    prompts: Sequence[Sequence[int]],
    shared: SharedDraws | None = None,
) -> Cell:
    runtime = c.drafter.runtime
    if runtime not in loaded:
        loaded[runtime] = targets(runtime)
    return _run_cell(loaded[runtime], c.drafter, c.config, c.label, prompts, shared)


def _announce(cell: Cell, on_cell: Callable[[Cell], None]) -> Cell:
    on_cell(cell)
    return cell


def _task(c: PlannedCell) -> tuple[str, ...]:
    """The task a cell runs in: a tree cell alone, or its drafter's chain and batch cells
    together (they draw the same batched samples: :class:`SharedDraws`), on its runtime.
    Small tasks let the workers finish together."""
    if c.config.mode.startswith("tree"):
        return c.drafter.label, c.drafter.runtime, c.config.mode, c.label
    return c.drafter.label, c.drafter.runtime, "chains"


def _groups(planned: Sequence[PlannedCell]) -> list[list[PlannedCell]]:
    """The workers' tasks (:func:`_task`), each loading its target once."""
    groups: dict[tuple[str, ...], list[PlannedCell]] = {}
    for c in planned:
        groups.setdefault(_task(c), []).append(c)
    return list(groups.values())


def _expected_cost(group: Sequence[PlannedCell]) -> tuple[bool, int]:
    """Longest tasks first, so that the workers finish together: transformers before
    native (slower forwards), then by cells (a drafter's chain and batch cells before a
    tree cell)."""
    return group[0].drafter.runtime == "hf", len(group)


def _pool(jobs: int, context: Any) -> ProcessPoolExecutor:
    """Worker processes that start clean (spawn: no copied torch or OpenMP state) and run
    one thread each, so that ``jobs`` of them share the cores without oversubscription;
    each exits once this process is gone (see :func:`_exit_with_parent`)."""
    return ProcessPoolExecutor(
        jobs, mp_context=context, initializer=_worker_start, initargs=(os.getpid(),)
    )


def _manager(context: Any) -> SyncManager:
    """The process that carries finished cells back, gone with this one too."""
    manager = SyncManager(ctx=context)
    manager.start(_exit_with_parent, (os.getpid(),))
    return manager


def _worker_start(parent: int) -> None:
    import torch

    torch.set_num_threads(1)
    _exit_with_parent(parent)


def _exit_with_parent(parent: int, every: float = 0.5) -> None:
    """In a helper process: exit as soon as process ``parent`` (the one that started it)
    is gone, whatever the helper is doing. Otherwise a killed `check --matrix` leaves
    its workers waiting for work that never comes."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _run_cell(target, drafter, config, label, prompts, shared=None) -> Cell:
    started = time.perf_counter()
    try:
        report = run_check(target, config, prompts, shared=shared)
    except ControlTooWeak as exc:
        return Cell(drafter, config.mode, label, time.perf_counter() - started,
                    problem=f"control not detected: {exc}")  # fmt: skip
    except ValueError as exc:
        return Cell(drafter, config.mode, label, time.perf_counter() - started,
                    problem=f"n/a: {exc}")  # fmt: skip
    cell = Cell(drafter, config.mode, label, report.seconds, report)
    if not report.control_detected:
        cell.problem = "control not detected at this N"
    return cell


def _fmt_p(p: float | None) -> str:
    return "–" if p is None else f"{p:.2g}"


def cell_row(cell: Cell) -> str:
    d = cell.drafter
    head = f"| {d.label} | {d.runtime} | {cell.mode} | {cell.sampling} |"
    if cell.report is None:
        reason = (cell.problem or "").replace("|", "/")
        return f"{head} – | – | – | – | – | {cell.seconds:.1f} | {reason} |"
    r = cell.report
    if r.config.greedy:
        n = f"{r.prompts}×{r.config.greedy_length} tok"
        tv, p_spec, p_ctl = "identical" if r.exact else "differs", "–", "–"
    else:
        n = f"{r.prompts}×{r.samples}{_looked(r)}{_drawn_how(r)}"
        tv = f"{r.tv_bound:.3f}"
        p_spec, p_ctl = _fmt_p(r.min_p(r.comparisons)), _fmt_p(r.min_p(r.control))
    verdict = "exact" if r.exact else f"**NOT EXACT** ({r.failing})"
    control = "detected" if r.control_detected else "**not detected**"
    return f"{head} {n} | {tv} | {p_spec} | {p_ctl} | {control} | {cell.seconds:.1f} | {verdict} |"


def _looked(report: CheckReport) -> str:
    """Which of a cell's looks (``CheckConfig.tv_goal``) it stopped at."""
    return "" if report.look is None else f" ({report.look})"


def _drawn_how(report: CheckReport) -> str:
    """How a coupled cell's sample was drawn (see ``CheckConfig.coupling``)."""
    c = report.coupling
    if c is None:
        return ""
    if c.differs is None:
        return f" (batched twin; {c.redrawn:,} of them identical alone)"
    return f" (alone: the batched twin differs at #{c.differs[1]})"


TABLE_HEAD = (
    "| drafter | runtime | mode | sampling | N (prompts × per prompt) | TV bound (99.9%) "
    "| min p (Holm) | control min p | control | s | verdict |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def section_markdown(title: str, cells: Sequence[Cell], note: str) -> str:
    rows = "\n".join(cell_row(c) for c in cells)
    checked = [c for c in cells if c.report is not None]
    summary = (
        f"{len(checked)} cells checked ({sum(c.report.exact for c in checked)} exact, "
        f"control detected in {sum(c.report.control_detected for c in checked)}), "
        f"{len(cells) - len(checked)} not run; "
        f"{sum(c.seconds for c in cells):.0f} s in all."
    )
    return f"## {title}\n\n{note}\n\n{summary}\n\n{TABLE_HEAD}\n{rows}\n"
