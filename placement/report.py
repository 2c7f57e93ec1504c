"""Human and machine renderings of a placement plan.

:func:`format_plan_table` is what ``raydp plan`` prints; :func:`plan_to_json`
is its ``--json`` form. :func:`render_table` is the plain-text table helper the
planner's error messages share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raydp.placement.inventory import Inventory
    from raydp.placement.planner import PlacementPlan, RankPlacement


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    """Left-aligned columns separated by two spaces, no trailing blanks."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(indent + line for line in lines)


def node_label(node_id: str, inventory: Inventory) -> str:
    """Short node id, with ``(head)`` appended for the head node."""
    short = inventory.short(node_id)
    head = inventory.head
    return f"{short} (head)" if head is not None and head.node_id == node_id else short


def format_plan_table(
    plan: PlacementPlan, inventory: Inventory, *, first_rank: int = 0, pool_of: Callable[[int], str] | None = None
) -> str:
    """A summary line and one row per rank: rank, node, ip, local rank, devices (and pool, given ``pool_of``).

    ``first_rank``: the cluster's rank of the plan's first (a P/D pool planned on its own).
    """
    rows = [_rank_row(plan, r, inventory, first_rank) for r in plan.ranks]
    headers: tuple[str, ...] = ("rank", "node", "ip", "local rank", "devices")
    if pool_of is not None:
        headers = (*headers, "pool")
        rows = [[*row, pool_of(r.rank + first_rank)] for row, r in zip(rows, plan.ranks, strict=True)]
    master = node_label(plan.master_node_id, inventory) if plan.master_node_id else "none"
    summary = (
        f"plan: dp_size={plan.dp_size} world_size={plan.world_size} accelerator={plan.accelerator} "
        f"strategy={plan.strategy} bundles={plan.bundle_strategy} master={master} "
        f"dp_size_local={plan.dp_size_local} nodes={len(plan.node_ids())} (* = on the master node)"
    )
    return summary + "\n" + render_table(headers, rows)


def _rank_row(plan: PlacementPlan, r: RankPlacement, inventory: Inventory, first_rank: int) -> list[str]:
    per_node = plan.world_size // len(r.node_ids)
    if len(r.node_ids) == 1:
        node = node_label(r.node_id, inventory) + (" *" if r.is_master else "")
        devices = f"{plan.world_size} {plan.accelerator}"
    else:
        node = " + ".join(node_label(n, inventory) for n in r.node_ids) + (" *" if r.is_master else "")
        devices = f"{len(r.node_ids)}x{per_node} {plan.accelerator}"
    return [str(r.rank + first_rank), node, r.node_ip, str(r.local_rank), devices]


def plan_to_json(
    plan: PlacementPlan, *, first_rank: int = 0, pool_of: Callable[[int], str] | None = None
) -> dict[str, Any]:
    """A JSON-serialisable dict with every field of the plan (ranks from ``first_rank``, with their pool)."""
    data = _plan_json(plan, first_rank)
    if pool_of is not None:
        for rank in data["ranks"]:
            rank["pool"] = pool_of(rank["rank"])
    return data


def _plan_json(plan: PlacementPlan, first_rank: int) -> dict[str, Any]:
    return {
        "dp_size": plan.dp_size,
        "world_size": plan.world_size,
        "accelerator": plan.accelerator,
        "strategy": plan.strategy,
        "bundle_strategy": plan.bundle_strategy,
        "master_node_id": plan.master_node_id,
        "dp_size_local": plan.dp_size_local,
        "ranks": [
            {
                "rank": r.rank + first_rank,
                "node_id": r.node_id,
                "node_ip": r.node_ip,
                "local_rank": r.local_rank,
                "is_master": r.is_master,
                "node_ids": list(r.node_ids),
                "bundle_node_ids": list(plan.bundle_node_ids(r.rank)),
            }
            for r in plan.ranks
        ],
    }
