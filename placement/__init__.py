"""Placement (installed as ``raydp.placement``): inventory -> plan -> placement groups.

Pure planning runs with no Ray; the Ray calls are confined to
``live.read_inventory`` and ``groups``, and importing this package does not
import Ray. Imports :mod:`raydp.config`, :mod:`raydp.errors` and
:mod:`raydp.names`; never a backend.

Modules:

- ``inventory``: the cluster's accelerator inventory, alive nodes and their free devices;
- ``plan``: the plan types the planner returns;
- ``planner``: the pure planner, inventory + DP layout -> a node (or node group) per rank;
- ``_layouts``: its per-strategy layout search;
- ``_explain``: its infeasibility messages (what was asked, what each node offers, what would fit);
- ``pools``: ranks cut into runs of one size (``size_runs``), and a P/D cluster's plans for ``raydp plan``;
- ``report``: the plan as a table or JSON;
- ``live``: what the connected Ray cluster holds now (a Ray call);
- ``groups``: the placement groups for a plan (Ray calls).
"""

from __future__ import annotations

from raydp.placement.groups import create_groups, group_name, remove_groups, validate_user_groups, wait_ready
from raydp.placement.inventory import Inventory, NodeInfo, inventory_from_nodes
from raydp.placement.live import read_inventory
from raydp.placement.planner import PlacementPlan, RankPlacement, plan_placement, rank_bundles, ranks_fit
from raydp.placement.report import format_plan_table, plan_to_json

__all__ = [
    "Inventory",
    "NodeInfo",
    "PlacementPlan",
    "RankPlacement",
    "create_groups",
    "format_plan_table",
    "group_name",
    "inventory_from_nodes",
    "plan_placement",
    "plan_to_json",
    "rank_bundles",
    "ranks_fit",
    "read_inventory",
    "remove_groups",
    "validate_user_groups",
    "wait_ready",
]
