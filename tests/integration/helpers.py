"""Assertions about what a closed cluster left behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ray.util.state import list_actors, list_placement_groups


def live_actors(name: str) -> list[str]:
    return [
        a.name
        for a in list_actors(filters=[("state", "!=", "DEAD")], raise_on_missing_output=False)
        if a.name and a.name.startswith(f"{name}-")
    ]


def live_groups(name: str) -> list[str]:
    return [
        g.name
        for g in list_placement_groups(raise_on_missing_output=False)
        if g.name.startswith(f"{name}-") and g.state != "REMOVED"
    ]


def socket_dirs(name: str) -> list[Path]:
    root = Path(tempfile.gettempdir()) / f"raydp-{os.getuid()}"
    return sorted(root.glob(f"{name}-*")) if root.exists() else []
