"""What a closed cluster left behind: live actors, placement groups and socket directories of a cluster name."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray


@dataclass(frozen=True)
class ActorRow:
    """One actor as the GCS's actor table has it."""

    actor_id: str
    name: str
    class_name: str
    state: str  # ALIVE, DEAD, RESTARTING, PENDING_CREATION, ...
    pid: int


def actor_table() -> list[ActorRow]:
    """Every actor this driver's cluster knows of, dead ones included, from the GCS.

    Not the state API (``ray.util.state``): that goes through the dashboard,
    which the test Rays do not start (its processes cost seconds of CPU per
    cluster on a 2-core machine) and which lags when the machine is busy.
    """
    from ray._private.state import actors  # the GCS's table: no public API reads it without a dashboard

    table: dict[str, Any] = actors()
    return [
        ActorRow(str(a["ActorID"]), str(a["Name"]), str(a["ActorClassName"]), str(a["State"]), int(a["Pid"]))
        for a in table.values()
    ]


def live_actors(name: str) -> list[str]:
    """Cluster ``name``'s actors that are not dead, by name."""
    return [a.name for a in actor_table() if a.name.startswith(f"{name}-") and a.state != "DEAD"]


def live_groups(name: str) -> list[str]:
    """Cluster ``name``'s placement groups not removed, by name (the GCS's table)."""
    groups: dict[str, Any] = ray.util.placement_group_table()
    return [
        str(g["name"])
        for g in groups.values()
        if str(g.get("name", "")).startswith(f"{name}-") and g.get("state") != "REMOVED"
    ]


def wait_until(predicate: Callable[[], object], timeout: float = 15.0) -> bool:
    """Poll ``predicate`` every 0.1 s until it holds or ``timeout`` passes; whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def socket_dirs(name: str) -> list[Path]:
    """Cluster ``name``'s IPC socket directories under this user's raydp root."""
    root = Path(tempfile.gettempdir()) / f"raydp-{os.getuid()}"
    return sorted(root.glob(f"{name}-*")) if root.exists() else []
