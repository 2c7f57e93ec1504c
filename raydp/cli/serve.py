"""``raydp serve``: launch a cluster and N HTTP API servers, then watch until a death or Ctrl-C."""

from __future__ import annotations

import argparse
from typing import Any

from raydp.cli.demo import ENGINES
from raydp.config import PLACEMENT_STRATEGIES


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="launch DP ranks plus HTTP API servers and serve until Ctrl-C or a death",
        description="Launch a data-parallel cluster and N API server processes sharing one "
        "listening socket (POST /v1/generate, GET /health). Exits non-zero naming the "
        "component if any engine, the coordinator or an API server dies; Ctrl-C shuts "
        "everything down cleanly.",
    )
    p.add_argument("--name", default="raydp", help="cluster name; actors and groups are named after it")
    p.add_argument("--dp-size", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--dp-size-local", type=int, default=None, help="ranks on the master node")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices per rank (TP)")
    p.add_argument("--engine", default="tiny-lm",
                   help=f"engine core: {', '.join(sorted(ENGINES))}, or a 'module:Class' path")
    p.add_argument("--lockstep", action="store_true", help="run ranks in request waves")
    p.add_argument("--accelerator", default="GPU", help="Ray resource of one device bundle (default GPU)")
    p.add_argument("--strategy", choices=PLACEMENT_STRATEGIES, default="fill",
                   help="placement strategy (default fill)")
    p.add_argument("--api-servers", type=int, default=1, help="API server processes (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address the API servers listen on")
    p.add_argument("--port", type=int, default=8000, help="port the API servers listen on (default 8000)")
    p.add_argument("--backend", choices=["ray", "mp"], default="ray",
                   help="ray (default): actors on the Ray cluster; mp: local processes, no Ray")
    p.add_argument("--address", default=None, help="Ray address (default: ambient cluster or a local one)")
    p.add_argument("--detached", action="store_true", help="actors outlive this process (for raydp.attach)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from raydp.cluster import launch

    cluster = launch(
        name=args.name,
        dp_size=args.dp_size,
        dp_size_local=args.dp_size_local,
        tensor_parallel_size=args.tensor_parallel_size,
        engine=ENGINES.get(args.engine, args.engine),
        lockstep=args.lockstep,
        accelerator=args.accelerator,
        placement_strategy=args.strategy,
        detached=args.detached,
        backend=args.backend,
        address=args.address,
    )
    with cluster:
        servers = cluster.serve_api(args.api_servers, host=args.host, port=args.port)
        print(f"raydp {cluster.name}: {cluster.dp_size} ranks, {args.api_servers} API servers at "
              f"{servers.url} (POST /v1/generate); Ctrl-C to stop", flush=True)
        cluster.wait()
    return 0
