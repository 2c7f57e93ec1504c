"""Ending a cluster that this process did not launch (``Cluster.shutdown`` on an attached handle)."""

from __future__ import annotations

from typing import Any

import ray

from actors.owned import Owned

NAMESPACE = "raydp"


def terminate_cluster(name: str, prefix: str) -> None:
    """End a cluster launched elsewhere (e.g. detached): its named actors, groups and IPC dirs."""
    from ray.util.placement_group import PlacementGroup, placement_group_table

    owned = Owned(name=prefix)
    for actor in _named_actors(name):
        owned.engines.append(actor)
    for info in placement_group_table().values():
        if _is_rank_group(info.get("name", ""), name) and info.get("state") != "REMOVED":
            gid = ray._raylet.PlacementGroupID(bytes.fromhex(info["placement_group_id"]))
            owned.groups.append(PlacementGroup(gid))
            owned.nodes.update(info.get("bundles_to_node_id", {}).values())
    owned.release()


def _named_actors(name: str) -> list[Any]:
    from ray.util import list_named_actors

    found = []
    for entry in list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and (
            entry["name"] == f"{name}-coordinator" or _is_rank_group(entry["name"], name)
        ):
            found.append(ray.get_actor(entry["name"], namespace=NAMESPACE))
    return found


def _is_rank_group(candidate: str, name: str) -> bool:
    prefix = f"{name}-dp"
    return candidate.startswith(prefix) and candidate[len(prefix):].isdigit()
