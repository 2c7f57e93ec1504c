"""Assertions about what a closed cluster left behind."""

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
    actors = _retry(
        lambda: list_actors(
            address=_address(), filters=[("state", "!=", "DEAD")], raise_on_missing_output=False
        )
    )
    return [a.name for a in actors if a.name and a.name.startswith(f"{name}-")]


def live_groups(name: str) -> list[str]:
    groups = _retry(lambda: list_placement_groups(address=_address(), raise_on_missing_output=False))
    return [g.name for g in groups if g.name.startswith(f"{name}-") and g.state != "REMOVED"]


def wait_until(predicate: Callable[[], object], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def socket_dirs(name: str) -> list[Path]:
    root = Path(tempfile.gettempdir()) / f"raydp-{os.getuid()}"
    return sorted(root.glob(f"{name}-*")) if root.exists() else []


def assert_nothing_left(name: str, *, timeout: float = 15.0, wait_sockets: bool = False) -> None:
    """Cluster ``name`` left no live actor, no placement group and no socket directory.

    ``wait_sockets`` allows the directories time to go, for teardowns that
    happen in another process (a finalizer, an exiting driver) rather than in
    a ``close()`` that has returned.
    """
    assert wait_until(lambda: not live_actors(name), timeout=timeout), live_actors(name)
    assert live_groups(name) == []
    if wait_sockets:
        assert wait_until(lambda: socket_dirs(name) == []), socket_dirs(name)
    else:
        assert socket_dirs(name) == []
