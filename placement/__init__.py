"""Placement from node inventory: inventory -> plan -> placement groups.

Pure planning lives in :mod:`placement.planner`; Ray calls live in
:mod:`placement.inventory` (``read_inventory``) and :mod:`placement.groups`.
Importing this package does not import Ray.
"""

from __future__ import annotations

from placement.groups import create_groups, group_name, remove_groups, validate_user_groups, wait_ready
from placement.inventory import Inventory, NodeInfo, inventory_from_nodes, read_inventory
from placement.planner import PlacementPlan, RankPlacement, plan_placement, rank_bundles, ranks_fit
from placement.report import format_plan_table, plan_to_json

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
