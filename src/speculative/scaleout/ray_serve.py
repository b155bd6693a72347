"""`speculative serve --replicas N`: N Ray Serve replicas of the server app behind one endpoint.

Every replica is a Ray actor that builds its own app (its own target, batched engine,
metrics registry) with the builder it is given; Ray Serve's HTTP proxy listens on
``host:port`` and spreads the requests over the replicas. The app is served as it is (Ray
Serve's ASGI ingress, the app's lifespan run in each replica), so endpoints, streaming,
errors and limits are the single server's. ``/metrics`` answers for the one replica that
took the request. The Responses API's kept answers live in one Ray actor
(:class:`RayRecords`) that every replica reads and writes, so a follow-up by
``previous_response_id``, a poll, a cancel or a deletion may reach any replica.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from speculative.scaleout.ray_batch import RayJobError, ray_session
from speculative.server.stored import LocalRecords, ResponseRecords

APP_NAME = "speculative"


def server_app(config: Any, records: Any = None) -> Any:
    """A replica's app: its own target, drafters and batched engine, from ``config``
    (a :class:`~speculative.server.ServerConfig`); its kept responses in ``records``
    (shared by the replicas) or, with None, its own memory."""
    from speculative.server import create_app, load_state

    return create_app(load_state(config), records)


class RayRecords:
    """The Responses API's kept answers in one Ray actor (a
    :class:`~speculative.server.stored.LocalRecords`) that every replica reads and
    writes: each method of :class:`~speculative.server.stored.ResponseRecords` is the
    actor's, a remote call away."""

    shared = True

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in RECORD_METHODS:
            raise AttributeError(name)
        method = getattr(self.actor, name)

        async def remote(*args: Any) -> Any:
            return await method.remote(*args)

        return remote


# what the replicas call on the shared records (the protocol's methods)
RECORD_METHODS = frozenset(
    name for name, value in vars(ResponseRecords).items()
    if callable(value) and not name.startswith("_")
)  # fmt: skip


def shared_records(capacity: int) -> RayRecords:
    """The replicas' kept responses: a new actor on the connected Ray instance (it goes
    with the driver that made it)."""
    import ray

    return RayRecords(ray.remote(num_cpus=0)(LocalRecords).remote(capacity))


def replicated_app(config: Any) -> Callable[[], Any]:
    """What each replica builds: ``config``'s app over records they all share (Ray must
    be connected)."""
    return functools.partial(server_app, config, shared_records(config.responses_stored))


def replica_deployment(serve: Any, build_app: Callable[[], Any], replicas: int, cpus: float):
    """The bound Ray Serve application: ``replicas`` copies of ``build_app()``."""

    @serve.deployment(
        name="SpeculativeServer", num_replicas=replicas, ray_actor_options={"num_cpus": cpus}
    )
    @serve.ingress()
    class SpeculativeServer:
        def __init__(self, build: Callable[[], Any]) -> None:
            self.build = build

        def __serve_build_asgi_app__(self) -> Any:
            import torch

            torch.set_num_threads(max(1, int(cpus)))
            return self.build()

    return SpeculativeServer.bind(build_app)


def import_serve() -> Any:
    try:
        from ray import serve
    except ImportError:
        raise RayJobError(
            "--replicas needs Ray Serve: pip install 'speculative[ray]' (or 'ray[serve]')"
        ) from None
    return serve


def start_replicas(
    build_app: Callable[[], Any],
    replicas: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    replica_cpus: float = 1,
    keep_alive_s: int = 5,
) -> str:
    """Deploy the replicas on the connected Ray instance; returns the endpoint's URL once
    every replica is up. ``build_app`` must pickle (it runs inside each replica)."""
    serve = import_serve()
    from ray.serve.config import HTTPOptions

    serve.start(http_options=HTTPOptions(host=host, port=port, keep_alive_timeout_s=keep_alive_s))
    app = replica_deployment(serve, build_app, replicas, replica_cpus)
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except Exception as exc:  # Ray Serve wraps a replica's start-up failure
        raise RayJobError(f"the replicas did not start: {exc}".splitlines()[0]) from None
    return f"http://{host}:{port}"


@contextmanager
def served(
    config: Any,
    replicas: int,
    address: str | None = None,
    **options: Any,
) -> Iterator[str]:
    """``replicas`` of ``config``'s app up for the duration of the block (Ray started and
    stopped if needed)."""
    with ray_session(address):
        try:  # an interrupt while the replicas start still takes them down
            yield start_replicas(replicated_app(config), replicas, **options)
        finally:
            import_serve().shutdown()


def serve_forever(config: Any, replicas: int, address: str | None = None, **options: Any) -> None:
    """Serve until interrupted (Ctrl-C), then take the replicas down."""
    with served(config, replicas, address, **options) as url:
        print(
            f"speculative: serving {replicas} Ray Serve replica(s) on {url} "
            "(playground at /, metrics at /metrics; Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(3600)
