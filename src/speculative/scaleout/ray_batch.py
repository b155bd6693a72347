"""The batched offline job on Ray: prompt rows split over N actors.

Each actor (:class:`BatchWorker`) loads the target once and runs the same
:class:`~speculative.batch_jobs.RowDecoder` as the local job on its share of the rows (every
N-th row, so the shares are alike and early rows finish early). Its method is a Ray streaming
generator: each row's result line comes back to the driver as soon as the row finishes, and
:func:`ray_rows` merges the actors' streams in arrival order (the caller puts them back in
input order).

``address``: None starts a local Ray instance, or joins the one ``RAY_ADDRESS`` names (or a
local one already running); ``ray://host:10001`` joins a remote cluster through Ray Client;
``auto`` joins the cluster this machine is a node of. A driver that already called
``ray.init`` keeps its instance (nothing is started or shut down).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from speculative.batch_jobs import BatchJob, Record, ResultLine, RowDecoder


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
    """One Ray actor: a target loaded once, decoding the rows it is given."""

    def __init__(self, job: BatchJob, threads: int) -> None:
        self.job, self.threads = job, threads
        self.decoder: RowDecoder | None = None

    def load(self) -> str:
        """Load the target (a method rather than in __init__, so a failure comes back as
        the worker's own exception); returns the node's host name."""
        import socket

        import torch

        torch.set_num_threads(self.threads)
        self.decoder = RowDecoder(self.job)
        return socket.gethostname()

    def run(self, items: Sequence[tuple[int, Record]]) -> Iterator[ResultLine]:
        """Decode ``(index, record)`` pairs; a streaming generator (one line per row)."""
        assert self.decoder is not None, "call load() first"
        yield from self.decoder.run(items)


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
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            where = address or "a local instance"
            raise RayJobError(f"cannot start or join Ray at {where}: {exc}") from None
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def worker_message(exc: Exception) -> str:
    """The one-line reason a worker failed (its own exception when Ray kept it)."""
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


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
            streams = [
                actor.run.options(num_returns="streaming").remote(share)
                for actor, share in zip(actors, work, strict=True)
            ]
            yield merged(ray, streams)
        finally:
            for actor in actors:
                ray.kill(actor)


def merged(ray: Any, streams: list[Any]) -> Iterator[ResultLine]:
    """The items of several Ray streaming generators, each as soon as it is ready."""
    waiting = list(streams)
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        for stream in ready:
            try:
                line = ray.get(next(stream))
            except StopIteration:
                continue
            except ray.exceptions.RayError as exc:
                raise RayJobError(f"a Ray worker failed: {worker_message(exc)}") from None
            waiting.append(stream)
            yield line
