"""Joining Ray: the given cluster, else the ambient one, else a local one."""

from __future__ import annotations

import logging
import os
from typing import Any


def connect(address: str | None = None, *, local: dict[str, Any] | None = None, quiet: bool = False) -> bool:
    """Connect this process to Ray; True if this call made the connection.

    ``address`` (or ``$RAY_ADDRESS``) names a cluster to join; without one a
    running cluster is joined if there is one, else a local Ray is started
    with ``local`` as its ``ray.init`` arguments (e.g. logical GPUs);
    ``"local"`` always starts a new one.
    """
    import ray

    if ray.is_initialized():
        return False
    opts: dict[str, Any] = {"log_to_driver": not quiet}
    if quiet:
        opts["logging_level"] = logging.WARNING
    target = address or os.environ.get("RAY_ADDRESS")
    if target == "local":  # Ray's own word for "start a new one", even if another runs here
        _start_local(local or {}, opts)
    elif target:
        ray.init(address=target, **opts)
    else:
        try:
            ray.init(address="auto", **opts)
        except ConnectionError:
            _start_local(local or {}, opts)
    return True


def _start_local(local: dict[str, Any], opts: dict[str, Any]) -> None:
    import ray

    cores = os.cpu_count() or 1
    if local.get("num_cpus", 0) > cores:
        logging.getLogger("raydp").warning(
            "starting a local Ray with %d logical CPUs on a %d-core machine: the ranks share (oversubscribe) "
            "the cores", local["num_cpus"], cores)
    # address="local": a new cluster even where ray.init() would find one (RAY_ADDRESS, the latest
    # cluster started on the machine).
    ray.init(address="local", **{"include_dashboard": False, **local, **opts})


def local_resources(dp_size: int, world_size: int, accelerator: str) -> dict[str, Any]:
    """``ray.init`` arguments for a Ray raydp starts itself: enough logical CPUs for the plan.

    With ``accelerator='CPU'`` each rank takes ``world_size`` CPU bundles plus one
    CPU for its engine core; a small machine still runs the plan, oversubscribed,
    as vLLM's own ``--data-parallel-size`` does. A cluster raydp joins is planned
    on what it has.
    """
    if accelerator != "CPU":
        return {}
    needed = dp_size * (world_size + 1)
    return {"num_cpus": needed} if needed > (os.cpu_count() or 1) else {}
