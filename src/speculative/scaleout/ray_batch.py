"""The batched offline job on Ray: prompt rows split over N actors.

Each actor (:class:`BatchWorker`) loads the target once and runs the same
:class:`~speculative.batch_jobs.RowDecoder` as the local job on its share of the rows (every
N-th row, so the shares are alike and early rows finish early), on a thread of its own. The
driver keeps one :meth:`BatchWorker.take` call in flight per actor: it returns the rows that
finished since the last call as soon as there is one, so each row's line reaches the driver
when its row finishes, and :func:`ray_rows` hands them on in arrival order (the caller puts
them back in input order). Plain calls rather than a Ray streaming generator: Ray Client
(``ray://``) does not carry streaming generators.

``address``: None starts a local Ray instance, or joins the one ``RAY_ADDRESS`` names (or a
local one already running); ``ray://host:10001`` joins a remote cluster through Ray Client;
``auto`` joins the cluster this machine is a node of. A driver that already called
``ray.init`` keeps its instance (nothing is started or shut down).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from speculative.batch_jobs import BatchJob, Record, ResultLine, RowDecoder

_DONE = "done"  # the decoding thread's last item


class RayJobError(RuntimeError):
    """Ray is missing or unreachable, or a worker failed: one line for the user."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayJobError(
            "Ray is not installed: pip install 'speculative[ray]' (or 'ray[serve]')"
        ) from None
    return ray


class BatchWorker:
    """One Ray actor: a target loaded once, decoding the rows it is given on a thread."""

    def __init__(self, job: BatchJob, threads: int) -> None:
        self.job, self.threads = job, threads
        self.decoder: RowDecoder | None = None
        self.lines: queue.Queue[ResultLine | BaseException | str] = queue.Queue()

    def load(self) -> str:
        """Load the target (a method rather than in __init__, so a failure comes back as
        the worker's own exception); returns the node's host name."""
        import torch

        torch.set_num_threads(self.threads)
        self.decoder = RowDecoder(self.job)
        return socket.gethostname()

    def start(self, items: Sequence[tuple[int, Record]]) -> None:
        """Begin decoding ``(index, record)`` pairs; :meth:`take` collects the lines."""
        assert self.decoder is not None, "call load() first"
        threading.Thread(target=self._decode, args=(self.decoder, items), daemon=True).start()

    def _decode(self, decoder: RowDecoder, items: Sequence[tuple[int, Record]]) -> None:
        try:
            for line in decoder.run(items):
                self.lines.put(line)
        except BaseException as exc:  # handed to the driver by take()
            self.lines.put(exc)
        finally:
            self.lines.put(_DONE)

    def take(self) -> tuple[list[ResultLine], bool]:
        """The lines finished since the last call (waits for at least one), and whether
        the share is done. Re-raises the decoding thread's error."""
        got, done = [self.lines.get()], False
        while not self.lines.empty():
            got.append(self.lines.get())
        lines = []
        for item in got:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, str):
                done = True
            else:
                lines.append(item)
        return lines, done


def shares(items: Sequence[tuple[int, Record]], workers: int) -> list[list[tuple[int, Record]]]:
    """Every ``workers``-th item to each worker (empty shares dropped)."""
    split = [list(items[w::workers]) for w in range(workers)]
    return [share for share in split if share]


@contextmanager
def ray_session(address: str | None) -> Iterator[Any]:
    """The ``ray`` module with a connected instance; shut down after if started here."""
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        check_reachable(address or os.environ.get("RAY_ADDRESS"))
        try:
            if (address or os.environ.get("RAY_ADDRESS", "")).startswith("ray://"):
                ray.init(address=address)  # Ray Client: the cluster's own settings
            else:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise RayJobError(connect_message(address, exc)) from None
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast on a HOST:PORT (or ray://HOST:PORT) nothing listens on: Ray itself
    retries for minutes."""
    if not address or ":" not in address.removeprefix("ray://"):
        return  # a local instance, "auto" or "local"
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise RayJobError(f"cannot reach Ray at {address}: {exc}") from None


def connect_message(address: str | None, exc: Exception) -> str:
    """Why Ray did not start or connect, with the usual fix for a remote cluster."""
    where = address or os.environ.get("RAY_ADDRESS")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = f"cannot start or join Ray at {where or 'a local instance'}: {text}"
    if where and "RAY_AUTH_MODE" not in os.environ:
        message += (
            " (a cluster with token authentication, Ray's default, needs RAY_AUTH_MODE=token "
            "and its token in RAY_AUTH_TOKEN or ~/.ray/auth_token)"
        )
    return message


def worker_message(exc: Exception) -> str:
    """The one-line reason a worker failed (its own exception when Ray kept it)."""
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextmanager
def ray_rows(
    job: BatchJob,
    items: Sequence[tuple[int, Record]],
    workers: int,
    address: str | None = None,
    worker_cpus: int = 1,
) -> Iterator[Iterator[ResultLine]]:
    """Start ``workers`` actors (``worker_cpus`` CPUs and torch threads each), load the
    target in each, and give an iterator over every row's result line as rows finish."""
    with ray_session(address) as ray:
        actor_class = ray.remote(num_cpus=worker_cpus)(BatchWorker)
        work = shares(items, workers)
        actors = [actor_class.remote(job, worker_cpus) for _ in work]
        try:
            try:
                ray.get([actor.load.remote() for actor in actors])
            except ray.exceptions.RayError as exc:
                raise RayJobError(f"a Ray worker could not load: {worker_message(exc)}") from None
            ray.get([a.start.remote(share) for a, share in zip(actors, work, strict=True)])
            yield collected(ray, actors)
        finally:
            for actor in actors:
                ray.kill(actor)


def collected(ray: Any, actors: Sequence[Any]) -> Iterator[ResultLine]:
    """Every actor's lines, each batch as soon as one actor has some."""
    calls = {actor.take.remote(): actor for actor in actors}
    while calls:
        ready, _ = ray.wait(list(calls), num_returns=1)
        for ref in ready:
            actor = calls.pop(ref)
            try:
                lines, done = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise RayJobError(f"a Ray worker failed: {worker_message(exc)}") from None
            if not done:
                calls[actor.take.remote()] = actor
            yield from lines
