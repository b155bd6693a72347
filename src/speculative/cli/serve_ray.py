"""`speculative serve --replicas N [--ray ADDRESS]`: the server as N Ray Serve replicas."""

from __future__ import annotations

import argparse
import sys

from speculative.cli.common import CliError, positive_int

REPLICAS_HELP = """\
Scale-out on Ray (pip install 'speculative[ray]'): --replicas N runs N replicas of this
server with Ray Serve behind one endpoint (--host/--port); each replica loads its own
target and batches its own requests (the Responses API's kept answers are shared, so a
follow-up may reach any replica), and /metrics answers for the replica that took the
request. --ray ADDRESS deploys on a cluster (ray://HOST:10001, or 'auto' on a node of
it; RAY_ADDRESS works too); without it a local Ray instance is started.
"""


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scale-out on Ray", REPLICAS_HELP)
    group.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="Ray Serve replicas behind the one endpoint (1 without --ray: plain uvicorn)",
    )
    group.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="serve through Ray: no ADDRESS a local instance (or RAY_ADDRESS's cluster)",
    )
    group.add_argument(
        "--replica-cpus",
        type=positive_int,
        default=1,
        help="CPUs reserved (and torch threads) per replica",
    )


def uses_ray(args: argparse.Namespace) -> bool:
    return args.replicas > 1 or args.ray is not None


def serve_replicas(args: argparse.Namespace, config: object) -> int:
    """Serve ``config``'s app as ``--replicas`` Ray Serve replicas until interrupted."""
    from speculative.scaleout.ray_batch import RayJobError
    from speculative.scaleout.ray_serve import serve_forever

    if args.port == 0:
        raise CliError("--replicas needs a fixed --port (Ray Serve's proxy binds it)")
    print(
        f"speculative: starting {args.replicas} Ray Serve replica(s) of {config.target}",
        file=sys.stderr,
    )
    try:
        serve_forever(
            config,
            args.replicas,
            args.ray or None,
            host=args.host,
            port=args.port,
            replica_cpus=args.replica_cpus,
            keep_alive_s=args.timeout_keep_alive,
        )
    except RayJobError as exc:
        raise CliError(str(exc)) from None
    return 0
