"""A P/D cluster's placement as ``raydp plan`` shows it: one plan per run of equal-sized ranks
(:func:`size_runs`, which the Ray runtime's placement cuts its ranks by too).

Pure: no Ray. A launch plans a P/D cluster whose pools differ in devices per
rank one pool after the other, each on what the groups of the one before left
free (:mod:`raydp.actors.slots`). A dry run creates no groups, so the next
pool is planned on the inventory less what the plans before it would take
(:func:`reserve`). Pools of one size are one plan, as at launch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from raydp.config import RaydpConfig
from raydp.placement.inventory import Inventory
from raydp.placement.plan import CPU, PlacementPlan
from raydp.placement.planner import plan_placement


@dataclass(frozen=True)
class PoolPlan:
    """One plan of ranks ``first_rank..first_rank + plan.dp_size - 1`` (the plan numbers them from 0)."""

    first_rank: int
    plan: PlacementPlan

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.plan.dp_size)


def pool_of(config: RaydpConfig, rank: int) -> str:
    """``prefill`` or ``decode`` for a P/D cluster's ``rank``; ``""`` for a cluster of one pool."""
    if not config.pooled:
        return ""
    return "prefill" if rank < config.prefill_dp_size else "decode"


def plan_pools(inventory: Inventory, config: RaydpConfig, master_node_id: str | None) -> list[PoolPlan]:
    """The cluster's plans, in rank order: one, or one per pool where the pools' devices per rank differ."""
    plans: list[PoolPlan] = []
    for run in size_runs(config, range(config.dp_size)):
        plan = plan_placement(
            inventory,
            dp_size=len(run),
            world_size=config.world_size_of(run.start),
            dp_size_local=None if config.pools_differ else config.dp_size_local,
            strategy=config.placement_strategy,
            master_node_id=master_node_id,
            node_allowlist=config.node_allowlist,
        )
        plans.append(PoolPlan(run.start, plan))
        inventory = reserve(inventory, plan)
    return plans


def size_runs(config: RaydpConfig, ranks: range) -> list[range]:
    """``ranks`` cut where the devices per rank change (a P/D cluster's pools may differ)."""
    runs: list[range] = []
    for rank in ranks:
        if runs and config.world_size_of(rank) == config.world_size_of(runs[-1].start):
            runs[-1] = range(runs[-1].start, rank + 1)
        else:
            runs.append(range(rank, rank + 1))
    return runs


def reserve(inventory: Inventory, plan: PlacementPlan) -> Inventory:
    """``inventory`` less the devices and engine-core CPUs that ``plan``'s groups would take."""
    devices: dict[str, float] = {}
    cpus: dict[str, float] = {}
    for rank in plan.ranks:
        for bundle, node_id in zip(plan.bundles(), plan.bundle_node_ids(rank.rank), strict=True):
            # With accelerator="CPU" a device bundle takes from both counts: they are one resource.
            devices[node_id] = devices.get(node_id, 0.0) + bundle.get(inventory.accelerator, 0.0)
            cpus[node_id] = cpus.get(node_id, 0.0) + bundle.get(CPU, 0.0)
    nodes = tuple(
        replace(
            node,
            available=node.available - devices.get(node.node_id, 0),
            cpus_available=None if node.cpus_available is None else node.cpus_available - cpus.get(node.node_id, 0),
        )
        for node in inventory.nodes
    )
    return Inventory(nodes, inventory.accelerator)
