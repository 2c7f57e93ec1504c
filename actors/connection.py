"""Joining Ray: the given cluster, else the ambient one, else a local one.

Ray 2.60 logs its token-authentication mode as a warning on every
connection that finds a token (``Token authentication is enabled...``), and
on a new local cluster. raydp replaces those two lines with one of its own
per process, saying which mode the joined cluster runs in: INFO when tokens
are on, WARNING when they are off (anyone who reaches the cluster's ports can
run code on it). Ray's other authentication messages (errors, a missing
token) pass untouched.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from raydp.config import RaydpConfig

logger = logging.getLogger("raydp")
auth_logger = logging.getLogger("raydp.auth")  # the CLI prints it as one line of its own
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_AUTH_NOTICES = (
    "Token authentication is enabled for this Ray cluster",
    "Token authentication is disabled for this Ray cluster",
)
_reported = threading.Event()


class _RayAuthNotice(logging.Filter):
    """Drops Ray's per-connection mode notices; :func:`report_auth_mode` says it once, in raydp's words."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_AUTH_NOTICES)


_RAY_AUTH_NOTICE = _RayAuthNotice()


def report_auth_mode(token_auth: bool) -> None:
    """Say once per process which authentication mode the joined Ray cluster runs in."""
    if _reported.is_set():
        return
    _reported.set()
    if token_auth:
        auth_logger.info(
            "Ray cluster: token authentication on (every node, driver and job needs the cluster's "
            "token: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        )
    else:
        auth_logger.warning(
            "Ray cluster: token authentication OFF: anyone who can reach its ports can run code on "
            "it; set RAY_AUTH_MODE=token with a token on every node (docs/operations.md: Ray token "
            "authentication)"
        )


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
    logging.getLogger(RAY_AUTH_LOGGER).addFilter(_RAY_AUTH_NOTICE)
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
    report_auth_mode(_token_auth())
    return True


@contextmanager
def connected(
    address: str | None = None, *, local: dict[str, Any] | None = None, quiet: bool = False
) -> Iterator[None]:
    """:func:`connect` for a block; a connection the block made is closed at its end (CLI commands)."""
    started = connect(address, local=local, quiet=quiet)
    try:
        yield
    finally:
        if started:
            import ray

            ray.shutdown()


def this_node_id() -> str:
    """The Ray node this process runs on (it must be connected)."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _token_auth() -> bool:
    # The compiled module's stub lists neither; they are what Ray's own setup code reads.
    from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]

    return bool(get_authentication_mode() == AuthenticationMode.TOKEN)


def _start_local(local: dict[str, Any], opts: dict[str, Any]) -> None:
    import ray

    cores = os.cpu_count() or 1
    if local.get("num_cpus", 0) > cores:
        logging.getLogger("raydp").warning(
            "starting a local Ray with %d logical CPUs on a %d-core machine: the ranks share (oversubscribe) the cores",
            local["num_cpus"],
            cores,
        )
    # address="local": a new cluster even where ray.init() would find one (RAY_ADDRESS, the latest
    # cluster started on the machine).
    ray.init(address="local", **{"include_dashboard": False, **local, **opts})


def local_resources(config: RaydpConfig) -> dict[str, Any]:
    """``ray.init`` arguments for a Ray raydp starts itself: enough logical CPUs for the plan.

    With ``accelerator='CPU'`` each rank takes ``world_size`` CPU bundles plus one
    CPU for its engine core; a small machine still runs the plan, oversubscribed,
    as vLLM's own ``--data-parallel-size`` does. A cluster raydp joins is planned
    on what it has.
    """
    if config.accelerator != "CPU":
        return {}
    needed = config.devices_before(config.dp_size) + config.dp_size
    return {"num_cpus": needed} if needed > (os.cpu_count() or 1) else {}
