"""What a closed cluster left behind: live actors, placement groups and socket directories of a cluster name."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

# Both read this driver's GCS, not the state API: that goes through the dashboard, which the test Rays
# do not start (it costs seconds of CPU per cluster on a 2-core machine) and which lags when busy.


def live_actors(name: str) -> list[str]:
    """Cluster ``name``'s actors that are not dead, by name."""
    from ray._private.state import actors  # the GCS's actor table: no public API reads it without a dashboard

    table: dict[str, Any] = actors()
    return [str(a["Name"]) for a in table.values() if str(a["Name"]).startswith(f"{name}-") and a["State"] != "DEAD"]


def live_groups(name: str) -> list[str]:
    """Cluster ``name``'s placement groups not removed, by name."""
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
