"""``raydp plan``: print where each DP rank would go, creating nothing.

Reads the connected cluster's inventory, runs the planner and prints the plan
table (or JSON). It never creates placement groups or actors, so it is safe
to run against a busy production cluster.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

from raydp.actors.connection import connected, this_node_id
from raydp.cli.options import add_config_flags, config_from_args
from raydp.config import RaydpConfig
from raydp.errors import ConfigError, PlacementError
from raydp.placement.inventory import Inventory
from raydp.placement.live import read_inventory
from raydp.placement.pools import PoolPlan, plan_pools, pool_of
from raydp.placement.report import format_plan_table, plan_to_json

EXIT_INFEASIBLE = 2
CONFIG_FLAGS = (
    "dp_size",
    "dp_size_local",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "accelerator",
    "placement_strategy",
    "node_allowlist",
    "master_node_id",
    "prefill_dp_size",
    "decode_dp_size",
    "prefill_tensor_parallel_size",
)


def add_parser(sub: Any) -> None:
    """Register the ``plan`` subcommand on an argparse subparsers object."""
    p = sub.add_parser(
        "plan",
        help="dry run: show where each DP rank would be placed (creates nothing)",
        description="Read the Ray cluster's node inventory and print the placement plan for "
        "a DP layout, without creating placement groups or actors.",
    )
    add_config_flags(p, CONFIG_FLAGS, {})
    p.add_argument(
        "--world-size", type=int, default=None, help="devices per rank, instead of tensor x pipeline parallel size"
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray address to connect to (default: $RAY_ADDRESS or the running cluster, else a temporary local Ray)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Plan and print; 0 on success, 2 when the layout does not fit or is invalid."""
    try:
        config = config_from_args(args, CONFIG_FLAGS, {})
    except ConfigError as exc:
        print(f"raydp plan: {exc}", file=sys.stderr)
        return EXIT_INFEASIBLE
    if args.world_size is not None:
        if config.pooled:
            print("raydp plan: --world-size: a P/D cluster's pools size their own ranks", file=sys.stderr)
            return EXIT_INFEASIBLE
        # Devices per rank, however they would be split: the planner sees only their number.
        config = config.model_copy(update={"tensor_parallel_size": args.world_size, "pipeline_parallel_size": 1})
    try:
        with connected(args.address, quiet=True):
            inventory = read_inventory(config.accelerator)
            plans = plan_pools(inventory, config, config.master_node_id or this_node_id())
    except (PlacementError, ConfigError) as exc:
        print(f"raydp plan: {exc}", file=sys.stderr)
        return EXIT_INFEASIBLE
    _print(plans, config, inventory, as_json=args.json)
    return 0


def _print(plans: list[PoolPlan], config: RaydpConfig, inventory: Inventory, *, as_json: bool) -> None:
    """One plan as before; a P/D cluster's with each rank's pool, and ``{"plans": [...]}`` as JSON."""
    pools = functools.partial(pool_of, config) if config.pooled else None
    if as_json:
        found = [plan_to_json(p.plan, first_rank=p.first_rank, pool_of=pools) for p in plans]
        print(json.dumps({"plans": found} if pools else found[0], indent=2))
        return
    tables = [format_plan_table(p.plan, inventory, first_rank=p.first_rank, pool_of=pools) for p in plans]
    print("\n\n".join(tables))
