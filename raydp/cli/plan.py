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

from raydp.actors.connection import connect
from raydp.config import PLACEMENT_STRATEGIES
from raydp.errors import ConfigError, PlacementError
from raydp.placement.inventory import Inventory, read_inventory
from raydp.placement.planner import PlacementPlan, plan_placement
from raydp.placement.report import format_plan_table, plan_to_json

EXIT_INFEASIBLE = 2


def add_parser(sub: Any) -> None:
    """Register the ``plan`` subcommand on an argparse subparsers object."""
    p = sub.add_parser(
        "plan",
        help="dry run: show where each DP rank would be placed (creates nothing)",
        description="Read the Ray cluster's node inventory and print the placement plan for "
        "a DP layout, without creating placement groups or actors.",
    )
    p.add_argument("--dp-size", type=int, required=True, help="number of data-parallel ranks")
    p.add_argument("--world-size", type=int, default=1,
                   help="devices per rank: tensor x pipeline parallel size (default 1)")
    p.add_argument("--dp-size-local", type=int, default=None,
                   help="ranks on the master node (default: as many as fit)")
    p.add_argument("--strategy", choices=PLACEMENT_STRATEGIES, default="fill",
                   help="fill: master then other nodes as they fit; strict: the same number of "
                   "ranks on every node used; span: one rank over several identical nodes (default fill)")
    p.add_argument("--accelerator", default="GPU",
                   help="Ray resource one device bundle asks for, e.g. GPU, TPU, neuron_cores, CPU "
                   "(default GPU)")
    p.add_argument("--allow", action="append", metavar="NODE", default=None,
                   help="node id (or unique prefix of >= 4 chars) that may host ranks; repeatable "
                   "(default: every node)")
    p.add_argument("--master", metavar="NODE", default=None,
                   help="master node id or unique prefix (default: this driver's node)")
    p.add_argument("--address", default=None,
                   help="Ray address to connect to (default: $RAY_ADDRESS or the running cluster, "
                   "else a temporary local Ray)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Plan and print; 0 on success, 2 when the layout does not fit or is invalid."""
    import ray

    started = connect(args.address, quiet=True)
    try:
        inventory = read_inventory(args.accelerator)
        master = args.master or ray.get_runtime_context().get_node_id()
        plan = _plan(inventory, args, master)
    except (PlacementError, ConfigError) as exc:
        print(f"raydp plan: {exc}", file=sys.stderr)
        return EXIT_INFEASIBLE
    finally:
        if started:
            ray.shutdown()
    _print(plan, inventory, as_json=args.json)
    return 0


def _plan(inventory: Inventory, args: argparse.Namespace, master: str) -> PlacementPlan:
    return plan_placement(
        inventory,
        dp_size=args.dp_size,
        world_size=args.world_size,
        dp_size_local=args.dp_size_local,
        strategy=args.strategy,
        master_node_id=master,
        node_allowlist=args.allow,
    )


def _print(plan: PlacementPlan, inventory: Inventory, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        print(format_plan_table(plan, inventory))
