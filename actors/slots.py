"""Where each rank runs: its placement group, node and devices (the Ray runtime's placement).

Each function returns :class:`~raydp.orchestration.ranks.RankRecord` objects
with the rank's group and node filled in; the orchestration sequences decide
when to place (launch, scale-up, a rank whose node died).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raydp.actors.engine import DeviceProbe, probe_device_ids
from raydp.actors.owned import Owned
from raydp.config import RaydpConfig
from raydp.errors import PlacementError
from raydp.orchestration.ranks import RankRecord
from raydp.placement.groups import (
    create_groups,
    create_unpinned_groups,
    remove_groups,
    validate_user_groups,
    wait_ready,
)
from raydp.placement.inventory import Inventory
from raydp.placement.live import read_inventory
from raydp.placement.planner import plan_placement
from raydp.placement.pools import size_runs

logger = logging.getLogger("raydp.manager")


def place_ranks(
    config: RaydpConfig, user_groups: Sequence[PlacementGroup] | None, driver_node_id: str, owned: Owned
) -> list[RankRecord]:
    """Validate the user's groups, or plan and create ours (recorded in ``owned``); wait until ready."""
    cfg = config
    if user_groups is not None and cfg.pools_differ:
        raise PlacementError(
            "placement_groups: a P/D cluster whose pools differ in tensor_parallel_size plans its own groups; "
            "leave placement_groups out"
        )
    if user_groups is not None:
        validate_user_groups(user_groups, dp_size=cfg.dp_size, world_size=cfg.world_size, accelerator=cfg.accelerator)
        wait_ready(user_groups, cfg.placement_timeout_s)
        return slots_from_groups(user_groups, owns_groups=False)
    if cfg.pools_differ:
        return _place_pools(cfg, driver_node_id, owned)
    plan = plan_placement(
        read_inventory(cfg.accelerator),
        dp_size=cfg.dp_size,
        world_size=cfg.world_size,
        dp_size_local=cfg.dp_size_local,
        strategy=cfg.placement_strategy,
        master_node_id=cfg.master_node_id or driver_node_id,
        node_allowlist=cfg.node_allowlist,
    )
    groups = create_groups(plan, cfg.name, lifetime="detached" if cfg.detached else None)
    owned.groups.extend(groups)
    wait_ready(groups, cfg.placement_timeout_s)
    return [RankRecord(r.rank, r.node_id, r.local_rank, g) for r, g in zip(plan.ranks, groups, strict=True)]


def _place_pools(config: RaydpConfig, driver_node_id: str, owned: Owned) -> list[RankRecord]:
    """A P/D cluster whose pools differ in devices per rank: each pool planned on what the one before left."""
    cfg, records = config, list[RankRecord]()
    for run in size_runs(cfg, range(cfg.dp_size)):
        plan = plan_placement(
            read_inventory(cfg.accelerator),
            dp_size=len(run),
            world_size=cfg.world_size_of(run.start),
            strategy=cfg.placement_strategy,
            master_node_id=cfg.master_node_id or driver_node_id,
            node_allowlist=cfg.node_allowlist,
        )
        groups = create_groups(plan, cfg.name, lifetime="detached" if cfg.detached else None, first_rank=run.start)
        owned.groups.extend(groups)
        wait_ready(groups, cfg.placement_timeout_s)  # reserved before the next pool reads what is free
        records += slots_from_groups(groups, run.start, records)
    return records


def _is_alive(inventory: Inventory, node: str) -> bool:
    """Whether ``node`` (an id or a unique prefix) names an alive node."""
    return any(n.node_id.startswith(node) for n in inventory.nodes)


def _alive_master(inventory: Inventory, wanted: str) -> str | None:
    """The master node to plan more ranks around, or None (the head) if it died: its ranks are being re-placed."""
    return wanted if _is_alive(inventory, wanted) else None


def _alive_allowlist(inventory: Inventory, allowlist: Sequence[str] | None) -> list[str] | None:
    """The allowlisted nodes still alive (a dead one's ranks are being re-placed on the others)."""
    if not allowlist:
        return None
    alive = [n for n in allowlist if _is_alive(inventory, n)]
    if not alive:
        raise PlacementError(f"node_allowlist={list(allowlist)!r}: no allowlisted node is alive")
    return alive


def place_more(
    config: RaydpConfig, ranks: range, existing: Sequence[RankRecord], driver_node_id: str, owned: Owned, why: str
) -> list[RankRecord]:
    """Groups for ``ranks`` (a scale-up, or a rank whose node died), planned on what is free now.

    If they do not fit and no allowlist pins the cluster to known nodes, the
    groups are made unpinned and left pending for up to ``placement_timeout_s``
    (an autoscaler sees Ray's pending demand and may add nodes); on timeout they
    are removed and :class:`~raydp.errors.PlacementTimeoutError` says why. A
    re-placed rank's old group must be removed first (its name is reused).
    """
    records: list[RankRecord] = []
    for run in size_runs(config, ranks):
        records += _place_run(config, run, [*existing, *records], driver_node_id, owned, why)
    return records


def _place_run(
    config: RaydpConfig, ranks: range, existing: Sequence[RankRecord], driver_node_id: str, owned: Owned, why: str
) -> list[RankRecord]:
    """:func:`place_more` for ranks of one size."""
    cfg, ws = config, config.world_size_of(ranks.start)
    lifetime = "detached" if cfg.detached else None
    inventory = read_inventory(cfg.accelerator)
    try:
        plan = plan_placement(
            inventory,
            dp_size=len(ranks),
            world_size=ws,
            strategy=cfg.placement_strategy,
            master_node_id=_alive_master(inventory, cfg.master_node_id or driver_node_id),
            node_allowlist=_alive_allowlist(inventory, cfg.node_allowlist),
        )
    except PlacementError as exc:
        if cfg.node_allowlist:
            raise PlacementError(f"{why}: the allowlisted nodes cannot hold {len(ranks)} more ranks:\n{exc}") from None
        plan = None
    if plan is not None:
        groups = create_groups(plan, cfg.name, lifetime=lifetime, first_rank=ranks.start)
    else:
        logger.warning(
            "%s: %d ranks do not fit the free capacity now; waiting up to %gs for nodes to join "
            "(an autoscaler sees the pending placement groups)",
            why,
            len(ranks),
            cfg.placement_timeout_s,
        )
        groups = create_unpinned_groups(
            cfg.name, ranks, ws, cfg.accelerator, span=cfg.placement_strategy == "span", lifetime=lifetime
        )
    try:
        wait_ready(groups, cfg.placement_timeout_s)
    except BaseException:
        remove_groups(groups)
        raise
    owned.groups.extend(groups)
    return slots_from_groups(groups, ranks.start, existing)


def start_device_probes(config: RaydpConfig, slots: Sequence[RankRecord]) -> list[DeviceProbe]:
    """One probe per rank, started: a task in each of its device bundles (none for CPU bundles).

    A node's probes run one after another (each waits for the one before), so
    they reuse one worker process instead of starting one per bundle: at
    startup those processes would compete with the ranks' own for the node's
    CPU and Ray's worker-start slots.
    """
    if config.accelerator == "CPU":
        return [DeviceProbe(()) for _ in slots]
    last: dict[str, Any] = {}  # node id -> the latest probe there
    probes = []
    for slot in slots:
        refs = []
        for i in range(config.world_size_of(slot.rank)):
            ref = probe_device_ids.options(
                **_device_request(config.accelerator),
                scheduling_strategy=PlacementGroupSchedulingStrategy(slot.group, i),
            ).remote(config.accelerator, *([last[slot.node_id]] if slot.node_id in last else []))
            last[slot.node_id] = ref
            refs.append(ref)
        probes.append(DeviceProbe(tuple(refs)))
    return probes


def _device_request(accelerator: str) -> dict[str, Any]:
    """Ray wants GPUs asked for as ``num_gpus``, custom resources in ``resources``."""
    if accelerator == "GPU":
        return {"num_gpus": 1}
    return {"resources": {accelerator: 1}}


def slots_from_groups(
    groups: Sequence[PlacementGroup],
    first_rank: int = 0,
    existing: Sequence[RankRecord] = (),
    owns_groups: bool = True,
) -> list[RankRecord]:
    from ray.util.placement_group import placement_group_table

    nodes = [placement_group_table(g)["bundles_to_node_id"] for g in groups]
    per_node: dict[str, int] = {}
    for slot in existing:
        per_node[slot.node_id] = per_node.get(slot.node_id, 0) + 1
    slots = []
    for rank, (group, bundle_nodes) in enumerate(zip(groups, nodes, strict=True), start=first_rank):
        node = bundle_nodes[max(bundle_nodes)]  # the engine core's CPU bundle comes last
        local = per_node.get(node, 0)
        per_node[node] = local + 1
        slots.append(RankRecord(rank, node, local, group, owns_groups))
    return slots
