"""API servers on another node: a small actor that hosts them there (hybrid and external modes).

In hybrid mode every node that holds ranks runs its own API servers, each
routing only to that node's ranks; in external mode every rank gets its own
endpoint, for an outside router. Either way the HTTP processes must start on
a chosen node, so an :class:`APIServerHost` actor, pinned there, spawns them
with :class:`~raydp.serve.processes.APIServerProcessManager` and binds the
node's own IP (never ``*``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydp.backend import APIServerGroup, APIServerSpec, DeathListener, notify
from raydp.config import COMPONENT_START_S
from raydp.errors import ComponentDeadError, ProcessDeadError, StartupError
from raydp.names import NAMESPACE
from raydp.serve.settings import ServerSettings
from raydp.wire.endpoints import ClusterEndpoints
from raydp.wire.transport import node_ip

logger = logging.getLogger("raydp.api")


class APIServerHost:
    """Hosts ``count`` API server processes on this actor's node.

    Its constructor returns once every process serves (or raises
    :class:`~raydp.errors.StartupError`). Methods: ``url()`` -> where they listen; ``watch()`` blocks until
    one of them dies and returns why; ``shutdown()`` ends them. States:
    created -> serving -> closed. If the actor itself dies, its processes
    see their parent-death pipe close and exit; the launcher sees the
    ``watch()`` ref fail and reports the servers dead.
    """

    def __init__(
        self,
        endpoints: ClusterEndpoints,
        count: int,
        port: int,
        ranks: list[int] | None,
        settings: ServerSettings | None = None,
    ) -> None:
        from raydp.serve.processes import APIServerProcessManager

        self._died = threading.Event()
        self._why = ""
        self._servers = APIServerProcessManager(
            endpoints,
            count,
            host=node_ip(),
            port=port,
            node_id=ray.get_runtime_context().get_node_id(),
            ranks=ranks,
            settings=settings,
        )
        self._servers.on_death(self._on_death)

    def _on_death(self, err: ComponentDeadError) -> None:
        self._why = str(err)
        self._died.set()

    def url(self) -> str:
        return self._servers.url

    def watch(self) -> str:
        self._died.wait()
        return self._why

    def shutdown(self) -> None:
        self._servers.close()


class RemoteAPIServers:
    """The launcher's handle on one :class:`APIServerHost`: its URL, its death, its end."""

    def __init__(self, spec: APIServerSpec) -> None:
        endpoints, node_id, port, settings, label = spec.endpoints, spec.node_id, spec.port, spec.settings, spec.label
        self.node_id, self.count, self.label = node_id, spec.count, spec.label
        self.ranks = list(spec.ranks)
        count = spec.count
        self._listeners: list[DeathListener] = []
        self._closed = threading.Event()
        self._actor = (
            ray.remote(APIServerHost)
            .options(
                num_cpus=0,
                namespace=NAMESPACE,
                max_concurrency=4,
                name=f"{endpoints.name}-api-{label}",
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote(endpoints, count, port, self.ranks, settings)
        )
        # The host's constructor returns once its servers serve: a process start, then theirs.
        timeout_s = COMPONENT_START_S + (settings or ServerSettings()).startup_timeout_s
        try:
            self.url: str = ray.get(self._actor.url.remote(), timeout=timeout_s)
        except Exception as exc:
            ray.kill(self._actor, no_restart=True)
            raise StartupError(f"API servers {label} on node {node_id} did not start: {exc}") from exc
        except BaseException:
            ray.kill(self._actor, no_restart=True)
            raise
        # The watch holds this group weakly, and a group nobody holds ends its host: dropped servers do
        # not serve on (nor keep their cluster alive, through its listener) until the process exits.
        watch = (weakref.ref(self), self._actor.watch.remote(), self._closed)
        threading.Thread(target=_watch, args=watch, name=f"raydp-{label}-watch", daemon=True).start()
        weakref.finalize(self, _end_host, self._actor, self._closed)

    def on_death(self, listener: DeathListener) -> None:
        self._listeners.append(listener)

    def tell(self, why: str) -> None:
        """The host's servers died (``why``): tell the listeners."""
        notify(self._listeners, ProcessDeadError(f"API servers {self.label} at {self.url} ({why})", None, self.node_id))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        _shut_host(self._actor)


def _watch(group: weakref.ref[RemoteAPIServers], watch_ref: Any, closed: threading.Event) -> None:
    try:
        why = ray.get(watch_ref)
    except Exception as exc:  # the host actor (or its node) died
        why = f"host actor died: {exc!r:.300}"
    servers = group()
    if servers is not None and not closed.is_set():
        servers.tell(why)


def _end_host(actor: Any, closed: threading.Event) -> None:
    """A dropped group's finalizer, on whatever thread collected it: end the host as close() does, on a
    thread of its own (it waits for the servers' drain)."""
    if closed.is_set() or not ray.is_initialized():
        return
    closed.set()
    try:
        threading.Thread(target=_shut_host, args=(actor,), name="raydp-api-host-end", daemon=True).start()
    except RuntimeError:  # the interpreter is shutting down: no new thread starts
        _shut_host(actor)


def _shut_host(actor: Any) -> None:
    """Stop the host's servers (they drain and release what they hold), then end the host actor."""
    try:
        ray.get(actor.shutdown.remote(), timeout=10)
    except Exception as exc:  # already dead: nothing left to stop
        logger.debug("API server host shutdown: %r", exc)
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # Ray is shutting down
        logger.debug("API server host kill: %r", exc)


class HostsRemoteAPIServers:
    """What the Ray backends share: API servers on a rank's node, under a small actor pinned there."""

    def start_api_servers(self, spec: APIServerSpec) -> APIServerGroup:
        return RemoteAPIServers(spec)
