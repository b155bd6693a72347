"""The one thread that does a server's model work: loading, calibration, drafters, rounds.

torch and the C kernels share one OpenMP runtime (both need ``libgomp.so.1``, and the
dynamic linker loads a soname once). libgomp keeps a pool of worker threads for every
thread that starts parallel work. Load the model on the main thread and decode on a
scheduler thread, and a 2-core machine holds more OpenMP threads than cores. libgomp then
stops spinning at barriers and sleeps at each of the ~120 barriers of a forward.

Measured on a 2-core AVX2 EPYC, int4 target, plain decoding of 128 tokens:
- 210 tok/s with everything on one thread;
- 60 tok/s with the model loaded on one thread and decoded on another.

So a server runs everything that may start OpenMP work on this one thread, and its
scheduler's loop runs here too.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class ComputeThread:
    """A daemon thread that runs submitted calls one after another, in order."""

    def __init__(self, name: str = "speculative-compute") -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        """The thread's identifier (what ``threading.get_ident()`` returns on it)."""
        return self._thread.ident

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the thread after the calls submitted before it."""
        future: Future[T] = Future()
        self._tasks.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the thread and wait for its result (its exception is raised here)."""
        if threading.get_ident() == self.ident:
            return fn()  # already on the thread: waiting for itself would never end
        return self.submit(fn).result()

    def _serve(self) -> None:
        while True:
            fn, future = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who decides
                future.set_exception(exc)
