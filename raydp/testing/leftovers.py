"""What a closed cluster left behind: live actors, placement groups and socket directories of a cluster name."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import ray
from ray.util.state import list_actors, list_placement_groups

T = TypeVar("T")


def _retry(fn: Callable[[], T], attempts: int = 5) -> T:
    """The state API goes through the dashboard, which may lag on a busy 2-core box."""
    for attempt in range(attempts):
        try:
            return fn()
        except ConnectionError:
            if attempt == attempts - 1:
                raise
            time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def _address() -> str:
    """This driver's cluster: without it the state API may query another cluster on the host."""
    return str(ray.get_runtime_context().gcs_address)


def live_actors(name: str) -> list[str]:
    """Cluster ``name``'s actors that are not dead, by name (the state API: the Ray needs its dashboard)."""
    actors = _retry(
        lambda: list_actors(address=_address(), filters=[("state", "!=", "DEAD")], raise_on_missing_output=False)
    )
    return [a.name for a in actors if a.name and a.name.startswith(f"{name}-")]


def live_groups(name: str) -> list[str]:
    """Cluster ``name``'s placement groups not removed, by name."""
    groups = _retry(lambda: list_placement_groups(address=_address(), raise_on_missing_output=False))
    return [g.name for g in groups if g.name.startswith(f"{name}-") and g.state != "REMOVED"]


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
