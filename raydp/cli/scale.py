"""``raydp scale NAME N``: grow or shrink a running detached cluster to N ranks.

It attaches to the cluster (``raydp.attach``) and runs ``Cluster.scale``,
which the cluster's supervisor carries out inside the cluster
(:mod:`raydp.actors.supervisor`); the cluster keeps running.
Clients in other processes (API servers, notebooks) follow from the
coordinator's snapshots.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from raydp.actors.connection import connected


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "scale",
        help="grow or shrink a running detached cluster to N ranks",
        description="Change how many DP ranks a running detached raydp cluster has. Growing places the "
        "new ranks on free capacity (or waits for nodes to join); shrinking drains the highest ranks first.",
    )
    p.add_argument("name", help="cluster name")
    p.add_argument("dp_size", type=int, metavar="N", help="the new number of DP ranks (>= 1)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="how long removed ranks may finish their requests (default: 30)",
    )
    p.add_argument(
        "--pool",
        choices=["decode", "prefill"],
        default=None,
        help="a P/D cluster: the pool that gets N ranks (the other pool keeps its size)",
    )
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS or the running cluster)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from raydp.api import attach
    from raydp.cluster import check_scale_args

    check_scale_args(args.dp_size, args.drain_timeout)
    with connected(args.address, quiet=True):
        cluster = attach(args.name)
        before, t0 = cluster.dp_size, time.monotonic()
        try:
            cluster.scale(args.dp_size, drain_timeout_s=args.drain_timeout, pool=args.pool)
        finally:
            cluster.close()
        what = f" ({args.pool} pool {args.dp_size})" if args.pool else ""
        print(f"{args.name}: {before} -> {cluster.dp_size} ranks{what} in {time.monotonic() - t0:.1f}s")
    return 0
