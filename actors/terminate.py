"""Ending actors and clusters: a cluster this process did not launch (``Cluster.shutdown`` on an
attached handle), and one actor whose name and bundle a successor needs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
import tenacity

from raydp.actors.owned import Owned
from raydp.names import NAMESPACE, coordinator_name, rank_name, supervisor_name

T = TypeVar("T")


def terminate_cluster(name: str, prefix: str) -> None:
    """End a cluster launched elsewhere (e.g. detached): its named actors, groups and IPC dirs."""
    from ray.util.placement_group import PlacementGroup, placement_group_table

    owned = Owned(name=prefix)
    for actor in _named_actors(name):
        owned.engines.append(actor)
    for info in placement_group_table().values():
        if _is_rank_group(info.get("name", ""), name) and info.get("state") != "REMOVED":
            gid = ray.PlacementGroupID(bytes.fromhex(info["placement_group_id"]))
            owned.groups.append(PlacementGroup(gid))
            owned.nodes.update(info.get("bundles_to_node_id", {}).values())
    owned.release()


def _named_actors(name: str) -> list[Any]:
    from ray.util import list_named_actors

    found = []
    for entry in list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and (
            entry["name"] in (coordinator_name(name), supervisor_name(name)) or _is_rank_group(entry["name"], name)
        ):
            found.append(ray.get_actor(entry["name"], namespace=NAMESPACE))
    return found


def _is_rank_group(candidate: str, name: str) -> bool:
    prefix = rank_name(name, 0)[:-1]
    return candidate.startswith(prefix) and candidate[len(prefix) :].isdigit()


def kill_and_wait(actor: Any, timeout_s: float = 10.0) -> None:
    """Kill ``actor`` and wait until Ray has released its name and resources.

    ``ray.kill`` returns before the actor is gone; a call to it fails once it is.
    """
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)  # every actor has it
        except Exception:  # RayActorError: gone; a get timeout: wedged, and Ray will reap it
            return
        time.sleep(0.05)


def create_successor(create: Callable[[], T], timeout_s: float = 10.0) -> T:
    """``create()`` an actor under the name of one that has just ended (a restarted rank or
    coordinator, a restarted gang, a rank added again by a scale-up).

    Ray tells a caller that an actor died (a failed call, a finished ref) before its GCS has
    released the actor's name, and creating the successor in that window raises
    ``ValueError: The name ... is already taken``. Retried until ``timeout_s``: a name held
    longer than that belongs to a live actor, and the error is raised.
    """
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_name_taken),
        wait=tenacity.wait_exponential(multiplier=0.01, max=0.25),
        stop=tenacity.stop_after_delay(timeout_s),
        reraise=True,
    )
    return retrying(create)


def _name_taken(exc: BaseException) -> bool:
    return isinstance(exc, ValueError) and "already taken" in str(exc)
