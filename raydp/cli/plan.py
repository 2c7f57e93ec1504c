"""``raydp plan``: print where each DP rank would go, creating nothing.

Reads the connected cluster's inventory, runs the planner and prints the plan
table (or JSON). It never creates placement groups or actors, so it is safe
to run against a busy production cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from raydp.actors.connection import connected, this_node_id
from raydp.cli.options import add_config_flags, config_from_args
from raydp.config import RaydpConfig
from raydp.errors import ConfigError, PlacementError
from raydp.placement.inventory import Inventory
from raydp.placement.live import read_inventory
from raydp.placement.planner import PlacementPlan, plan_placement
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
    try:
        with connected(args.address, quiet=True):
            inventory = read_inventory(config.accelerator)
            master = config.master_node_id or this_node_id()
            plan = _plan(inventory, config, args.world_size or config.world_size, master)
    except (PlacementError, ConfigError) as exc:
        print(f"raydp plan: {exc}", file=sys.stderr)
        return EXIT_INFEASIBLE
    _print(plan, inventory, as_json=args.json)
    return 0


def _plan(inventory: Inventory, config: RaydpConfig, world_size: int, master: str) -> PlacementPlan:
    return plan_placement(
        inventory,
        dp_size=config.dp_size,
        world_size=world_size,
        dp_size_local=config.dp_size_local,
        strategy=config.placement_strategy,
        master_node_id=master,
        node_allowlist=config.node_allowlist,
    )


def _print(plan: PlacementPlan, inventory: Inventory, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        print(format_plan_table(plan, inventory))
