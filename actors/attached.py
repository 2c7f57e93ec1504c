"""The backend of a handle on a cluster that another process launched (``raydp.attach``).

It reaches the cluster through its coordinator actor, found by name on every
call (a restarted coordinator keeps the name, not the handle). It creates
nothing and owns nothing: ``close()`` leaves the cluster running, and only
``terminate()`` (``Cluster.shutdown``) ends it. Deaths reach an attached
handle's clients straight from the coordinator's snapshots (they follow its
liveness themselves), so ``on_death`` and ``on_restart`` have nothing to add.
A scale change runs in the cluster's supervisor (:mod:`raydp.actors.supervisor`),
which a cluster launched with ``detached=True`` has.

Also what ``raydp status`` reads: :func:`running_clusters` and :func:`cluster_status`.
"""

from __future__ import annotations

from typing import Any

import ray

from raydp.actors.api_servers import HostsRemoteAPIServers
from raydp.backend import DeathListener, MovedListener, RestartListener, ScaleListener
from raydp.config import RaydpConfig
from raydp.errors import ConfigError, CoordinatorDeadError, DeathCause
from raydp.names import NAMESPACE, coordinator_name
from raydp.wire.endpoints import ClusterEndpoints
from raydp.wire.records import APIServerRecord, ClusterStatus, CoordinatorStatus

CALL_TIMEOUT_S = 30.0
_SUFFIX = coordinator_name("")


class AttachedBackend(HostsRemoteAPIServers):
    """A running cluster, reached by name; see the module docstring. Make one with :meth:`find`."""

    def __init__(self, name: str, endpoints: ClusterEndpoints, config: RaydpConfig) -> None:
        self.name = name
        self.endpoints = endpoints
        self.config = config
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self._scale_listeners: list[ScaleListener] = []

    @classmethod
    def find(cls, name: str) -> AttachedBackend:
        """The running cluster ``name``: ConfigError if there is none (or it is still starting)."""
        coordinator = find_coordinator(name)
        try:
            endpoints, config = ray.get(
                [coordinator.cluster.remote(), coordinator.config.remote()], timeout=CALL_TIMEOUT_S
            )
        except ray.exceptions.RayError as exc:
            raise CoordinatorDeadError(f"of cluster {name!r}", None, DeathCause.UNKNOWN, repr(exc)) from exc
        if endpoints is None or config is None:
            raise ConfigError(f"name={name!r}: the cluster is still starting")
        return cls(name, endpoints, config)

    def start(self) -> ClusterEndpoints:
        """Already running: its endpoints as found."""
        return self.endpoints

    def close(self) -> None:
        """Nothing to release: the cluster is not this handle's to end."""

    def terminate(self) -> None:
        """End the cluster itself: its supervisor closes it, then whatever is left is swept."""
        from raydp.actors.supervisor import end_supervisor
        from raydp.actors.terminate import terminate_cluster

        end_supervisor(self.name)
        terminate_cluster(self.name, self.endpoints.ipc_prefix)

    def on_death(self, listener: DeathListener) -> None:
        """Never called: the clients hear of rank deaths from the coordinator (see the module docstring)."""

    def on_restart(self, listener: RestartListener) -> None:
        """Never called: the clients hear of restarted ranks from the coordinator."""

    def on_coordinator_moved(self, listener: MovedListener) -> None:
        """Never called: the clients ask an engine where a silent coordinator went."""

    def coordinator_state(self) -> CoordinatorStatus:
        state: CoordinatorStatus = ray.get(find_coordinator(self.name).state.remote(), timeout=CALL_TIMEOUT_S)
        return state

    def scale(self, dp_size: int, drain_timeout_s: float, pool: str | None = None) -> ClusterEndpoints:
        """Through the cluster's supervisor; this handle's clients then follow the final endpoints."""
        from raydp.actors.supervisor import supervised_scale

        self.endpoints = supervised_scale(self.name, dp_size, drain_timeout_s, pool)
        for listener in self._scale_listeners:
            listener(self.endpoints, len(self.endpoints.engines), drain_timeout_s)
        return self.endpoints

    def on_scale(self, listener: ScaleListener) -> None:
        """Called at each step of a scale change made through this handle (others reach clients by snapshot)."""
        self._scale_listeners.append(listener)

    def register_api_servers(self, record: APIServerRecord) -> None:
        """Waited for, so that a ``raydp status`` right after lists them; through the supervisor where
        there is one, which also hands them to a restarted coordinator."""
        from raydp.actors.supervisor import find_supervisor

        supervisor = find_supervisor(self.name)
        target = supervisor if supervisor is not None else find_coordinator(self.name)
        method = target.register_api_servers if supervisor is not None else target.add_api_servers
        ray.get(method.remote(record), timeout=CALL_TIMEOUT_S)


def find_coordinator(name: str) -> Any:
    """The coordinator actor of cluster ``name``; ConfigError if none runs."""
    try:
        return ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
    except ValueError:
        raise ConfigError(f"name={name!r}: no raydp cluster of that name is running") from None


def running_clusters() -> list[str]:
    """Names of the raydp clusters whose coordinator actor is alive."""
    from ray.util import list_named_actors

    found = list_named_actors(all_namespaces=True)
    return sorted(
        e["name"][: -len(_SUFFIX)] for e in found if e["namespace"] == NAMESPACE and e["name"].endswith(_SUFFIX)
    )


def cluster_status(name: str, timeout_s: float = CALL_TIMEOUT_S) -> ClusterStatus:
    """Cluster ``name``'s endpoints (None while it starts), coordinator state and info, read at once."""
    coordinator = find_coordinator(name)
    endpoints, state, info = ray.get(
        [coordinator.cluster.remote(), coordinator.state.remote(), coordinator.info.remote()], timeout=timeout_s
    )
    return ClusterStatus(name, endpoints, state, info)
