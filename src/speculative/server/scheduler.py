"""One thread owns the batched engine; requests join and leave between rounds.

HTTP handlers (on the event loop) :meth:`Scheduler.submit` a :class:`Job` and read its
events from an asyncio queue. The scheduler thread (the server's compute thread, where it
has one) admits queued jobs while the batch has room (the others wait: the ``waiting``
gauge), taking each row's drafter as it admits it, runs one round for every active row, and
hands each row its round through ``loop.call_soon_threadsafe``. A cancelled job (its
client went away) leaves the batch before the next round, freeing its slot at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from speculative.drafters.base import Drafter
from speculative.engine.batch import BatchEngine, BatchRequest
from speculative.engine.loop import GenerationResult, Round
from speculative.engine.stats import GenerationStats
from speculative.server.compute import ComputeThread


@dataclass(frozen=True)
class RoundEvent:
    round: Round


@dataclass(frozen=True)
class DoneEvent:
    result: GenerationResult


@dataclass(frozen=True)
class ErrorEvent:
    message: str


Event = RoundEvent | DoneEvent | ErrorEvent


@dataclass
class Job:
    """One request in the scheduler: its engine request and where its events go."""

    request: BatchRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    on_release: Callable[[Drafter | None], None] | None = None  # gives the drafter back
    # the row's drafter, taken when the job is admitted (on the scheduler's thread, which
    # may build one); None: request.drafter as given
    acquire: Callable[[], Drafter | None] | None = None
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    row_id: int | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)  # the row's, as it goes
    cancelled: bool = False
    done: bool = False
    priority: int = 0  # under the priority policy: admitted lowest first

    def send(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class SchedulerObserver:
    """Hooks the metrics listen to (all called on the scheduler thread)."""

    def on_admit(self, job: Job) -> None: ...

    def on_round(self, job: Job, round_: Round) -> None: ...

    def on_step(self, batch: int, waiting: int, running: int) -> None: ...

    def on_finish(self, job: Job, status: str, result: GenerationResult | None) -> None:
        """status: "ok", "cancelled" or "error"."""


class Scheduler:
    """Runs the engine's rounds on a background thread while rows are active."""

    def __init__(
        self,
        engine: BatchEngine,
        observer: SchedulerObserver | None = None,
        max_waiting: int = 256,
        compute: ComputeThread | None = None,
        by_priority: bool = False,
    ) -> None:
        """compute: run the rounds there (the thread that loaded the model, see
        :mod:`speculative.server.compute`); None: on a thread of the scheduler's own,
        started with it."""
        self.engine = engine
        self.compute = compute
        self.observer = observer or SchedulerObserver()
        self.max_waiting = max_waiting
        self.by_priority = by_priority  # the queue ordered by job priority, else arrival
        self._queue: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # active rows
        self._cancels: list[Job] = []
        self._forgets: list[threading.Event] = []  # reset_prefix_cache calls to answer
        self._wake = threading.Condition()
        self._stopping = False
        self._running: Future | None = None  # the loop, on its thread
        self.error: str | None = None

    # ---- called from any thread ---------------------------------------------------
    def start(self) -> None:
        with self._wake:
            if self._running is not None:
                return
            if self.compute is None:
                self.compute = ComputeThread("speculative-scheduler")
            self._running = self.compute.submit(self._run)

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
            running, self._running = self._running, None
        if running is not None:
            running.result(timeout=30)

    def submit(self, job: Job) -> None:
        """Queue a job (after every waiting job of its priority or a lower value, under
        the priority policy; else last); ValueError when too many are already waiting."""
        with self._wake:
            if len(self._queue) >= self.max_waiting:
                raise ValueError(f"the server is busy: {len(self._queue)} requests are waiting")
            self._queue.insert(self._place(job), job)
            self._wake.notify()

    def _place(self, job: Job) -> int:
        """Where a job joins the queue: last, or (by priority) before the first waiting job
        of a higher value."""
        if self.by_priority:
            for i, queued in enumerate(self._queue):
                if queued.priority > job.priority:
                    return i
        return len(self._queue)

    def cancel(self, job: Job) -> None:
        """Stop a job (before or during decoding); its slot is freed before the next round."""
        with self._wake:
            if job.done or job.cancelled:
                return
            job.cancelled = True
            self._cancels.append(job)
            self._wake.notify()

    def reset_prefix_cache(self) -> threading.Event:
        """Have later rows start from no finished row's cached prompt or reply (done on
        the scheduler's thread between rounds; the event is set once it is)."""
        done = threading.Event()
        with self._wake:
            self._forgets.append(done)
            self._wake.notify()
        return done

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._jobs)

    @property
    def free_slots(self) -> int:
        return self.engine.max_batch - len(self._jobs)

    # ---- the scheduler thread -----------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (
                    self._stopping or self._queue or self._jobs or self._cancels or self._forgets
                ):
                    self._wake.wait()
                if self._stopping:
                    break
                cancels, self._cancels = self._cancels, []
                forgets, self._forgets = self._forgets, []
            try:
                self._turn(cancels, forgets)
            except Exception as exc:  # the loop goes on: later requests are still served
                self._fail_running(f"the scheduler failed: {type(exc).__name__}: {exc}")
        for job in [*self._jobs.values(), *self._queue]:
            self._fail(job, "the server is shutting down")

    def _turn(self, cancels: list[Job], forgets: list[threading.Event]) -> None:
        """One turn of the loop: cancellations, cache resets, admissions, a round."""
        for job in cancels:
            self._drop(job)
        if forgets:
            self.engine.forget_finished()
            for done in forgets:
                done.set()
        self._admit()
        if self._jobs:
            self._step()

    def _fail_running(self, message: str) -> None:
        """Fail every row in the batch with ``message`` (their slots freed)."""
        self.error = message
        for row_id, job in list(self._jobs.items()):
            del self._jobs[row_id]
            if row_id in self.engine.rows:
                self.engine.cancel(row_id)
            self.engine.finished.pop(row_id, None)
            self._fail(job, message)

    def _drop(self, job: Job) -> None:
        """A cancelled job leaves the queue or the batch (its slot is freed now)."""
        with self._wake:
            if job in self._queue:
                self._queue.remove(job)
                self._end(job, "cancelled", None, ErrorEvent("cancelled"))
                return
        if job.row_id is not None and job.row_id in self._jobs:
            del self._jobs[job.row_id]
            result = self.engine.cancel(job.row_id)
            self.engine.finished.pop(job.row_id, None)
            self._end(job, "cancelled", result, DoneEvent(result))

    def _admit(self) -> None:
        while len(self._jobs) < self.engine.max_batch:
            with self._wake:
                if not self._queue:
                    return
                job = self._queue.popleft()
            if job.acquire is not None:
                try:
                    job.request = replace(job.request, drafter=job.acquire())
                except Exception as exc:  # a drafter that cannot be built fails its job
                    self._fail(job, f"building the drafter failed: {type(exc).__name__}: {exc}")
                    continue
            try:
                job.row_id = self.engine.add(job.request, job.stats)
            except ValueError as exc:
                self._fail(job, str(exc))
                continue
            except Exception as exc:  # an unexpected failure fails this row, not the server
                self._fail(job, f"starting the row failed: {type(exc).__name__}: {exc}")
                continue
            job.admitted = time.perf_counter()
            self._jobs[job.row_id] = job
            self.observer.on_admit(job)

    def _step(self) -> None:
        batch = len(self._jobs)
        try:
            rounds = self.engine.step()
        except Exception as exc:  # a failing pass fails its rows, not the server
            self._fail_running(f"decoding failed: {type(exc).__name__}: {exc}")
            return
        for row_id, round_ in rounds.items():
            job = self._jobs[row_id]
            if round_.reason != "error":  # a failed row's round is its ErrorEvent
                self.observer.on_round(job, round_)
                job.send(RoundEvent(round_))
            if round_.finished:
                del self._jobs[row_id]
                result = self.engine.finished.pop(row_id)
                if result.error is not None:  # this row failed (its constraint), not the pass
                    self._fail(job, result.error)
                else:
                    self._end(job, "ok", result, DoneEvent(result))
        self.observer.on_step(batch, self.waiting, len(self._jobs))

    def _end(self, job: Job, status: str, result: GenerationResult | None, event: Event) -> None:
        job.done = True
        if job.on_release is not None:
            job.on_release(job.request.drafter)
        self.observer.on_finish(job, status, result)
        job.send(event)

    def _fail(self, job: Job, message: str) -> None:
        self._end(job, "error", None, ErrorEvent(message))
