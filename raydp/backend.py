"""The backend interface, and the pieces both backends share.

A *backend* starts one cluster's coordinator and engine cores, watches them,
and tears them down: :class:`raydp.actors.ActorManager` on Ray,
:class:`raydp.local.ProcessManager` as local processes; or reaches a cluster
that another process launched: :class:`raydp.actors.attached.AttachedBackend`.
:class:`~raydp.cluster.Cluster` sees each one only through :class:`Backend`.

What both share is written here once:

* :class:`DeathReports`: record a death, tell the coordinator (which
  republishes it to every client, in every process), then tell the listeners;
  and announce a restarted rank the same way;
* :class:`OwnedResources`: what a launch created on this side (ZMQ context,
  the front-end's IPC directory, closers), released exactly once, whether by
  ``close()``, garbage collection or interpreter exit.

Layer: above wire, engine, coordinator and client; no Ray.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from raydp.config import RaydpConfig
from raydp.coordinator.client import CoordinatorClient
from raydp.errors import ComponentDeadError, DeathCause, EngineDeadError
from raydp.wire.endpoints import ClusterEndpoints, EngineEndpoint
from raydp.wire.records import APIServerRecord, CoordinatorStatus
from raydp.wire.transport import IpcDir

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

    def scale(self, dp_size: int, drain_timeout_s: float) -> ClusterEndpoints:
        """Grow or shrink to ``dp_size`` ranks; returns the endpoints after the change."""
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


class DeathReports:
    """Deaths and restarts as a backend reports them; thread-safe."""

    def __init__(self) -> None:
        self.deaths: list[ComponentDeadError] = []
        self._listeners: list[DeathListener] = []
        self._restart_listeners: list[RestartListener] = []
        self._moved_listeners: list[MovedListener] = []
        self.coordinator: CoordinatorClient | None = None  # set once the coordinator serves
        self._lock = threading.Lock()
        # What the coordinator also tallies, kept here for a restarted one (its state died with it).
        self.dead: dict[int, str] = {}
        self.death_counts: dict[int, int] = {}
        self.restart_counts: dict[int, int] = {}
        self.hang_counts: dict[int, int] = {}

    def on_death(self, listener: DeathListener) -> None:
        self._listeners.append(listener)

    def on_restart(self, listener: RestartListener) -> None:
        self._restart_listeners.append(listener)

    def on_coordinator_moved(self, listener: MovedListener) -> None:
        self._moved_listeners.append(listener)

    def coordinator_moved(self, endpoints: ClusterEndpoints) -> None:
        """The coordinator restarted on another node: every listener follows it to ``endpoints``."""
        logger.warning(
            "the coordinator of cluster %r moved to node %s", endpoints.name, endpoints.coordinator.node_id[:12]
        )
        for listener in list(self._moved_listeners):
            try:
                listener(endpoints)
            except Exception:
                logger.exception("coordinator-moved listener failed")

    def died(self, err: ComponentDeadError) -> None:
        """Record ``err``; the coordinator hears of a dead rank before the local listeners do."""
        with self._lock:
            self.deaths.append(err)
            if isinstance(err, EngineDeadError):
                if err.rank not in self.dead:
                    self.death_counts[err.rank] = self.death_counts.get(err.rank, 0) + 1
                    if err.cause is DeathCause.HUNG:
                        self.hang_counts[err.rank] = self.hang_counts.get(err.rank, 0) + 1
                self.dead[err.rank] = err.cause.value
        if isinstance(err, EngineDeadError) and self.coordinator is not None:
            self.coordinator.engine_dead(err.rank, err.cause.value)
        notify(self._listeners, err)

    def revived(self, endpoint: EngineEndpoint) -> None:
        with self._lock:
            self.dead.pop(endpoint.rank, None)
            self.restart_counts[endpoint.rank] = self.restart_counts.get(endpoint.rank, 0) + 1
        if self.coordinator is not None:
            self.coordinator.engine_revived(endpoint.rank, endpoint.input_addresses, endpoint.node_id)
        logger.warning("engine rank %d restarted and rejoined", endpoint.rank)
        for listener in list(self._restart_listeners):
            try:
                listener(endpoint)
            except Exception:
                logger.exception("restart listener failed")


@dataclass
class OwnedResources:
    """What one launch owns on the launching side; :meth:`release` runs once.

    Holds no reference to its backend, so that a ``weakref.finalize`` can
    release it. Subclasses stop their components in :meth:`stop_components`.
    """

    name: str = ""  # the launch's IPC prefix
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None
    ipc_dir: IpcDir | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        with self.lock:  # a restart in flight must not add components behind our back
            if self.released:
                return
            self.released = True
        self.stop.set()
        self.stop_components()
        for close in self.closers:
            try:
                close()
            except Exception:  # one failing closer must not leak the rest
                logger.exception("release step failed")
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        if self.ipc_dir is not None:
            self.ipc_dir.remove()

    def stop_components(self) -> None:
        """End the processes or actors this launch started (the backend's part)."""
