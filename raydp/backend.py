"""The backend interface, and the pieces both backends share.

A *backend* starts one cluster's coordinator and engine cores, watches them,
and tears them down: :class:`raydp.actors.ActorManager` on Ray,
:class:`raydp.local.ProcessManager` as local processes; or reaches a cluster
that another process launched: :class:`raydp.actors.attached.AttachedBackend`.
:class:`~raydp.cluster.Cluster` sees each one only through :class:`Backend`.

Beside the protocol: the listener types, and :func:`notify`, which both
backends and the API server groups use to tell listeners of a death.
(``DeathReports`` and ``OwnedResources`` live in :mod:`raydp.orchestration`.)

Layer: above wire, engine, coordinator and client; no Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from raydp.config import RaydpConfig
from raydp.errors import ComponentDeadError
from raydp.wire.endpoints import ClusterEndpoints, EngineEndpoint
from raydp.wire.records import APIServerRecord, CoordinatorStatus

DeathListener = Callable[[ComponentDeadError], None]
RestartListener = Callable[[EngineEndpoint], None]
MovedListener = Callable[[ClusterEndpoints], None]  # the coordinator moved: the cluster's new endpoints
logger = logging.getLogger("raydp.deaths")


class APIServerGroup(Protocol):
    """API server processes serving one cluster at ``url`` (see :mod:`raydp.serve`)."""

    @property
    def url(self) -> str: ...

    def on_death(self, listener: DeathListener) -> None: ...

    def close(self) -> None: ...


ScaleListener = Callable[[ClusterEndpoints, int, "float | None"], None]


class Backend(Protocol):
    """What :class:`~raydp.cluster.Cluster` needs from whatever runs the engines."""

    config: RaydpConfig

    def start(self) -> ClusterEndpoints:
        """Create everything and wait until it serves; on failure release it all and raise."""
        ...

    def close(self) -> None:
        """Release everything this backend created. Idempotent."""
        ...

    def on_death(self, listener: DeathListener) -> None:
        """Call ``listener`` with the typed error of every component death."""
        ...

    def on_restart(self, listener: RestartListener) -> None:
        """Call ``listener`` with the new endpoint once a dead rank has rejoined."""
        ...

    def on_coordinator_moved(self, listener: MovedListener) -> None:
        """Call ``listener`` with the cluster's endpoints once its coordinator restarted on another node."""
        ...

    def coordinator_state(self) -> CoordinatorStatus:
        """The coordinator's wave, running flag, counts and counters."""
        ...

    def scale(self, dp_size: int, drain_timeout_s: float, pool: str | None = None) -> ClusterEndpoints:
        """Grow or shrink to ``dp_size`` ranks (a P/D cluster: ``pool`` to ``dp_size``); returns the new endpoints."""
        ...

    def on_scale(self, listener: ScaleListener) -> None:
        """Call ``listener(endpoints, size, drain_timeout_s)`` at each step of a scale change."""
        ...

    def register_api_servers(self, record: APIServerRecord) -> None:
        """Note where API servers listen, so that ``raydp status`` can list them."""
        ...

    def start_api_servers(self, spec: APIServerSpec) -> APIServerGroup:
        """Start the API servers ``spec`` describes (hybrid and external modes)."""
        ...


@dataclass(frozen=True)
class APIServerSpec:
    """``count`` API servers on node ``node_id`` that route to ``ranks``, on ``port`` (0: any free one).

    ``label`` names the group (its host actor, under Ray); ``settings`` is their
    :class:`~raydp.serve.settings.ServerSettings` (None: the defaults), typed
    loosely here because this layer sits below ``serve``.
    """

    endpoints: ClusterEndpoints
    node_id: str
    ranks: list[int]
    count: int
    port: int
    label: str
    settings: Any = None


def notify(listeners: Sequence[DeathListener], err: ComponentDeadError) -> None:
    """Log a death and tell every listener; one failing listener does not silence the others."""
    logger.error("%s", err)
    for listener in list(listeners):
        try:
            listener(err)
        except Exception:
            logger.exception("death listener failed")
