"""``SupervisorActor``: a detached cluster's supervision, running inside the cluster.

A cluster launched with ``detached=True`` must heal and scale after the
process that launched it is gone (a notebook that closed, a ``raydp serve``
that stopped). So its :class:`~raydp.actors.manager.ActorManager` (and with
it the shared orchestration: watching run refs, dense and gang restarts,
coordinator restarts, node re-placement, scaling) runs in this detached
named actor, and every process, the launcher included, holds an attached
handle (:class:`SupervisedBackend`) that reaches it by name.

Protocol (actor methods, each a Ray call):

* ``start()`` -> the cluster's endpoints, once it serves (raises the typed startup error);
* ``scale(dp_size, drain_timeout_s)`` -> the endpoints after the change;
* ``register_api_servers(record)``: kept for a restarted coordinator;
* ``deaths()`` -> every component death reported so far, typed;
* ``close()``: ends the cluster (actors, groups, IPC directories); the actor is then killed.

States: created -> serving (``start`` returned) -> closed. Failure: a failed
``start`` releases what it made and raises. If the supervisor itself dies
(its node went), the cluster serves on unsupervised: its ranks keep serving
and ``raydp.attach(...).shutdown()`` still ends it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydp.actors.attached import CALL_TIMEOUT_S, AttachedBackend
from raydp.actors.manager import ActorManager
from raydp.backend import DeathListener
from raydp.config import RaydpConfig
from raydp.errors import ComponentDeadError, ConfigError
from raydp.logs import configure_component_logging
from raydp.names import NAMESPACE, supervisor_name
from raydp.wire.endpoints import ClusterEndpoints
from raydp.wire.records import APIServerRecord

logger = logging.getLogger("raydp.manager")
DEATH_POLL_S = 0.25  # how often the launcher reads the supervisor's deaths


class SupervisorActor:
    """See the module docstring."""

    def __init__(self, config: RaydpConfig, engine_cls: type | None, placement_groups: Sequence[Any] | None) -> None:
        configure_component_logging(f"{config.name} supervisor")
        self.manager = ActorManager(config, placement_groups=placement_groups, engine_cls=engine_cls)

    def start(self) -> ClusterEndpoints:
        return self.manager.start()

    def scale(self, dp_size: int, drain_timeout_s: float, pool: str | None = None) -> ClusterEndpoints:
        return self.manager.scale(dp_size, drain_timeout_s, pool)

    def register_api_servers(self, record: APIServerRecord) -> None:
        self.manager.register_api_servers(record)

    def deaths(self) -> list[ComponentDeadError]:
        return self.manager.deaths

    def close(self) -> None:
        self.manager.close()


def find_supervisor(name: str) -> Any | None:
    """The supervisor actor of cluster ``name``, or None (none was launched, or it died)."""
    try:
        return ray.get_actor(supervisor_name(name), namespace=NAMESPACE)
    except ValueError:
        return None


class SupervisedBackend(AttachedBackend):
    """The launcher's handle on the detached cluster it launched: like any attached handle, but
    ``close()`` ends the cluster (as closing a launched cluster always does)."""

    @classmethod
    def launch(
        cls, config: RaydpConfig, engine_cls: type | None, placement_groups: Sequence[Any] | None, node_id: str
    ) -> SupervisedBackend:
        """Start the supervisor (on this node, where the launch was asked for) and the cluster under it."""
        supervisor = (
            ray.remote(SupervisorActor)
            .options(
                name=supervisor_name(config.name),
                namespace=NAMESPACE,
                lifetime="detached",
                num_cpus=0,
                max_concurrency=8,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True),
            )
            .remote(config, engine_cls, placement_groups)
        )
        try:
            endpoints = ray.get(supervisor.start.remote(), timeout=_start_timeout(config))
        except ray.exceptions.RayTaskError as exc:
            _end(supervisor)
            raise exc.as_instanceof_cause() from None
        except BaseException:
            _end(supervisor)
            raise
        return cls(config.name, endpoints, config)

    def __init__(self, name: str, endpoints: ClusterEndpoints, config: RaydpConfig) -> None:
        super().__init__(name, endpoints, config)
        self._listeners: list[DeathListener] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def on_death(self, listener: DeathListener) -> None:
        """The supervisor's typed deaths, polled from it: the launcher's ``wait()`` and ``deaths`` see them."""
        self._listeners.append(listener)
        if self._watcher is None:
            # The thread holds this backend weakly: once its handle is gone (a detached cluster lives
            # on), nobody is left to tell, and the polling ends.
            args = (weakref.ref(self), self._stop, self.name)
            name = "raydp-supervised-deaths"
            self._watcher = threading.Thread(target=_poll_deaths, args=args, name=name, daemon=True)
            self._watcher.start()

    def tell(self, deaths: Sequence[ComponentDeadError]) -> None:
        """Tell this handle's listeners of ``deaths`` (the polling thread's call)."""
        for err in deaths:
            for listener in list(self._listeners):
                listener(err)

    def close(self) -> None:
        self._stop.set()
        self.terminate()


def _poll_deaths(backend: weakref.ref[SupervisedBackend], stop: threading.Event, name: str) -> None:
    seen = 0
    while not stop.wait(DEATH_POLL_S):
        supervisor = find_supervisor(name)
        if supervisor is None:
            return
        try:
            deaths: list[ComponentDeadError] = ray.get(supervisor.deaths.remote(), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayError:
            return  # it ended (a close from another process) or its node went
        listening = backend()
        if listening is None:
            return
        listening.tell(deaths[seen:])
        del listening
        seen = max(seen, len(deaths))


def supervised_scale(name: str, dp_size: int, drain_timeout_s: float, pool: str | None = None) -> ClusterEndpoints:
    """Scale cluster ``name`` through its supervisor (raises ConfigError if it has none)."""
    supervisor = find_supervisor(name)
    if supervisor is None:
        raise ConfigError(
            f"name={name!r}: this cluster has no supervisor; only the process that launched it "
            "can scale it (launch it with detached=True to scale it from elsewhere)"
        )
    try:
        endpoints: ClusterEndpoints = ray.get(supervisor.scale.remote(dp_size, drain_timeout_s, pool))
    except ray.exceptions.RayTaskError as exc:
        raise exc.as_instanceof_cause() from None
    return endpoints


def end_supervisor(name: str) -> None:
    """Close the cluster from inside (its supervisor releases what it made), then end the supervisor."""
    supervisor = find_supervisor(name)
    if supervisor is None:
        return
    try:
        ray.get(supervisor.close.remote(), timeout=CALL_TIMEOUT_S)
    except ray.exceptions.RayError as exc:  # gone or wedged: the caller's sweep ends what is left
        logger.warning("the supervisor of cluster %r did not close it (%r); sweeping", name, exc)
    _end(supervisor)


def _end(actor: Any) -> None:
    from raydp.actors.terminate import kill_and_wait

    kill_and_wait(actor)


def _start_timeout(config: RaydpConfig) -> float:
    return config.placement_timeout_s + config.startup_timeout_s + config.handshake_timeout_s + CALL_TIMEOUT_S
