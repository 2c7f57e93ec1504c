"""Joining Ray: the given cluster, else the ambient one, else a local one."""

from __future__ import annotations

import logging
import os
from typing import Any


def connect(address: str | None = None, *, local: dict[str, Any] | None = None, quiet: bool = False) -> bool:
    """Connect this process to Ray; True if this call made the connection.

    ``address`` (or ``$RAY_ADDRESS``) names a cluster to join; without one a
    running cluster is joined if there is one, else a local Ray is started
    with ``local`` as its ``ray.init`` arguments (e.g. logical GPUs).
    """
    import ray

    if ray.is_initialized():
        return False
    opts: dict[str, Any] = {"log_to_driver": not quiet}
    if quiet:
        opts["logging_level"] = logging.WARNING
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        ray.init(address=target, **opts)
        return True
    try:
        ray.init(address="auto", **opts)
    except ConnectionError:
        ray.init(**{"include_dashboard": False, **(local or {}), **opts})
    return True
