"""A manager for a detached cluster that another process launched, so that it can be scaled.

``raydp scale NAME N`` and ``Cluster.scale`` on an attached handle rebuild
what the launcher knew from what the cluster keeps about itself: the
coordinator holds the endpoints, the config and the engine class; the rank
actors and placement groups are found by name. The adopted manager watches
nothing and owns nothing: :meth:`~raydp.actors.manager.ActorManager.leave`
drops only its own sockets, and the cluster lives on.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table

from raydp.actors.manager import ActorManager
from raydp.actors.slots import slots_from_groups
from raydp.errors import ConfigError
from raydp.names import NAMESPACE, coordinator_name, rank_name


def adopt(name: str) -> ActorManager:
    """The manager of running detached cluster ``name``; raises ConfigError if there is none."""
    try:
        coordinator = ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
    except ValueError:
        raise ConfigError(f"name={name!r}: no raydp cluster of that name is running") from None
    endpoints, launch, info = ray.get(
        [coordinator.cluster.remote(), coordinator.launch.remote(), coordinator.info.remote()], timeout=30
    )
    if endpoints is None or launch is None:
        raise ConfigError(f"name={name!r}: the cluster is still starting")
    config = launch.config
    if not config.detached:
        raise ConfigError(
            f"name={name!r}: only the process that launched this cluster can scale it "
            "(launch it with detached=True to scale it from elsewhere)"
        )
    manager = ActorManager(config, engine_cls=launch.engine_cls, curve=endpoints.curve, prefix=endpoints.ipc_prefix)
    n = len(endpoints.engines)
    records = slots_from_groups([_group_named(rank_name(name, r)) for r in range(n)])
    devices = info.devices or [[] for _ in range(n)]
    for record in records:
        record.handle = ray.get_actor(rank_name(name, record.rank), namespace=NAMESPACE)
        record.devices = tuple(devices[record.rank])
        record.capacity = endpoints.capacity // n
    manager.adopt(endpoints, coordinator, records)
    return manager


def _group_named(name: str) -> PlacementGroup:
    """By name across namespaces: the launcher's job made it in a namespace of its own."""
    for info in placement_group_table().values():
        if info.get("name") == name and info.get("state") != "REMOVED":
            return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(info["placement_group_id"])))
    raise ConfigError(f"placement group {name!r} of the cluster is gone")
