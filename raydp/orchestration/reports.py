"""Deaths and restarts as the orchestrator reports them: :class:`DeathReports`.

A death is recorded, told to the coordinator (which republishes it to every
client, in every process), then to this process's listeners; a restarted
rank is announced the same way. The tallies are kept here too, for a
restarted coordinator whose own died with it.
"""

from __future__ import annotations

import logging
import threading

from raydp.backend import DeathListener, MovedListener, RestartListener, notify
from raydp.coordinator.client import CoordinatorClient
from raydp.errors import ComponentDeadError, DeathCause, EngineDeadError
from raydp.wire.endpoints import ClusterEndpoints, EngineEndpoint

logger = logging.getLogger("raydp.deaths")


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


__all__ = ["DeathReports"]
