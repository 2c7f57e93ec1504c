"""The :class:`Cluster` handle that :func:`raydp.launch` and :func:`raydp.attach` return (:mod:`raydp.api`)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from raydp.backend import APIServerGroup, APIServerSpec, Backend
from raydp.config import RaydpConfig
from raydp.errors import (
    ClusterClosedError,
    ComponentDeadError,
    ConfigError,
    EngineDeadError,
)
from raydp.handle_refs import close_all, weakly
from raydp.orchestration.pools import plan
from raydp.wire.endpoints import ClusterEndpoints, EngineEndpoint
from raydp.wire.records import APIServerRecord, CoordinatorStatus

if TYPE_CHECKING:
    from raydp.client.balancer import Policy
    from raydp.client.client import Client
    from raydp.serve.processes import APIServerProcessManager
    from raydp.serve.settings import ServerSettings

logger = logging.getLogger("raydp")
WAIT_POLL_S = 0.05  # how often Cluster.wait looks for a final death: its latency, at no cost worth counting


class Cluster:
    """A running raydp cluster: make clients, watch for deaths, close.

    ``close()`` is idempotent and also runs at interpreter exit. Clients made
    by :meth:`client` are told of dead ranks at once (their in-flight requests
    on that rank fail with :class:`~raydp.errors.EngineDeadError`).

    Whatever runs the cluster is its :class:`~raydp.backend.Backend`: one that
    launched it, or one attached to it (:mod:`raydp.actors.attached`).
    ``node_id`` is this process's node as the endpoints name nodes (None:
    none of theirs); ``follow_liveness``: the backend reports no deaths, so
    clients follow the coordinator's word on them; ``terminate`` is what
    :meth:`shutdown` adds to :meth:`close` (ending a cluster that closing the
    backend leaves running).
    """

    def __init__(
        self,
        manager: Backend,
        endpoints: ClusterEndpoints,
        *,
        node_id: str | None = None,
        follow_liveness: bool = False,
        terminate: Callable[[], None] | None = None,
    ) -> None:
        self._manager = manager
        self.endpoints = endpoints
        self.config: RaydpConfig = manager.config
        self._node_id = node_id
        self._follow_liveness = follow_liveness
        self._terminate = terminate
        self._clients: list[Client] = []
        # The finalizer holds only the clients' closers: a client holds its
        # handle, so holding the clients would keep the handle alive forever.
        self._closers: list[Callable[[], None]] = []
        self._api_servers: list[APIServerGroup] = []
        self._lock = threading.Lock()
        self._deaths: list[ComponentDeadError] = []
        self._dead_ranks: dict[int, EngineDeadError] = {}  # dead now (a restart may revive them)
        self._closed = False
        # Dropping the last handle, once no client it made is held either
        # (each keeps its handle alive), closes the clients and, via the
        # manager's own finalizer, the actors, as close() would.
        weakref.finalize(self, close_all, self._closers)
        # Held weakly: the backend's threads hold its listeners (a watch mid-round, a restart), and a
        # listener holding this handle would keep a dropped handle alive for as long as they run.
        manager.on_death(weakly(self._on_death))
        manager.on_restart(weakly(self._on_restart))
        manager.on_coordinator_moved(weakly(self._on_coordinator_moved))
        manager.on_scale(weakly(self._on_scale))

    @property
    def name(self) -> str:
        return self.endpoints.name

    @property
    def dp_size(self) -> int:
        return len(self.endpoints.engines)

    @property
    def capacity(self) -> int:
        """The engines' summed capacity, as reported in the handshake."""
        return self.endpoints.capacity

    def client(
        self,
        *,
        client_index: int = 0,
        client_count: int = 1,
        balancer: Policy = "least-loaded",
        migration_limit: int = 3,
        prefix_load_margin: int | None = None,
        adapter_affinity: bool = True,
        kv_timeout_s: float | None = None,
    ) -> Client:
        """A new :class:`~raydp.client.client.Client` wired to this cluster.

        ``balancer`` picks how it chooses a rank: ``least-loaded`` (by the
        coordinator's published load and its own sends since), or the usual
        alternatives ``power-of-two`` and ``round-robin``, or ``prefix`` (cache
        affinity by the prompt's prefix, within ``prefix_load_margin`` of the
        least-loaded rank; default 16). ``migration_limit`` bounds how often a
        ``migratable=True`` stream may move when its rank dies.
        ``adapter_affinity`` (with ``least-loaded`` and ``prefix``) sends a
        request for a LoRA adapter to a rank that holds it, unless that rank
        is much busier than the least-loaded one (False: adapter-blind).
        ``kv_timeout_s`` (P/D pools): how long a decode rank may take to make a
        request's first token after its prefill before the request fails with
        :class:`~raydp.errors.KVTransferError` (default 120).
        """
        from raydp.client.client import Client

        extra: dict[str, Any] = {} if prefix_load_margin is None else {"prefix_load_margin": prefix_load_margin}
        if kv_timeout_s is not None:
            extra["kv_timeout_s"] = kv_timeout_s
        with self._lock:
            if self._closed:
                raise ClusterClosedError(f"cluster {self.name!r} is closed")
            client = Client(
                self.endpoints,
                node_id=self._node_id,
                client_index=client_index,
                client_count=client_count,
                follow_liveness=self._follow_liveness,
                balancer=balancer,
                migration_limit=migration_limit,
                adapter_affinity=adapter_affinity,
                owner=self,
                **extra,
            )
            for err in self._dead_ranks.values():
                client.mark_dead(err)
            self._clients.append(client)
            self._closers.append(client.closer)
            return client

    def serve_api(
        self, count: int = 1, *, host: str = "127.0.0.1", port: int = 0, settings: ServerSettings | None = None
    ) -> APIServerProcessManager:
        """Start ``count`` HTTP API server processes sharing one socket on ``host:port``.

        They are watched like the engines (a death makes :meth:`wait` raise)
        and closed with the cluster. ``settings`` sets their timeouts and
        limits. Returns the manager, once every server serves; its ``url``
        says where. A server that exits first, or is not serving within
        ``settings.startup_timeout_s``, raises :class:`~raydp.errors.StartupError`.
        """
        from raydp.serve.processes import APIServerProcessManager

        self._check_open()
        servers = APIServerProcessManager(
            self.endpoints, count, host=host, port=port, node_id=self._node_id, settings=settings
        )
        self._adopt(servers, "internal", self._node_id, None, count)
        return servers

    def serve_api_per_node(
        self, count: int = 1, *, port: int = 0, settings: ServerSettings | None = None
    ) -> list[APIServerGroup]:
        """Hybrid mode: ``count`` API servers on every node that holds ranks, each routing to its node's ranks.

        Each node's servers bind that node's IP on ``port`` (0: any free port).
        Returns one group per node; their ``url`` says where. ``settings`` as for
        :meth:`serve_api`; a ``tokenizer`` directory must be at the same path on every node.
        """
        by_node: dict[str, list[int]] = {}
        for ep in self.endpoints.engines:
            by_node.setdefault(ep.node_id, []).append(ep.rank)
        return self._serve_groups([(node, ranks, count, port) for node, ranks in by_node.items()], "hybrid", settings)

    def serve_api_per_rank(self, *, port: int = 0, settings: ServerSettings | None = None) -> list[APIServerGroup]:
        """External mode: one API server per rank, on the rank's node, for an outside router.

        Rank ``r`` listens on ``port + r`` (any free port if ``port`` is 0);
        each one's ``/metrics`` reports its rank's load.
        """
        groups = [(ep.node_id, [ep.rank], 1, port + ep.rank if port else 0) for ep in self.endpoints.engines]
        return self._serve_groups(groups, "external", settings)

    def _serve_groups(
        self, groups: list[tuple[str, list[int], int, int]], mode: str, settings: ServerSettings | None
    ) -> list[APIServerGroup]:
        self._check_open()
        started: list[APIServerGroup] = []
        try:
            for node_id, ranks, count, port in groups:
                spec = APIServerSpec(self.endpoints, node_id, ranks, count, port, f"{mode}-dp{ranks[0]}", settings)
                servers = self._manager.start_api_servers(spec)
                started.append(servers)
                self._adopt(servers, mode, node_id, ranks, count)
        except BaseException:
            for servers in started:
                servers.close()
            raise
        return started

    def _adopt(
        self, servers: APIServerGroup, mode: str, node_id: str | None, ranks: list[int] | None, count: int
    ) -> None:
        """Watch ``servers`` like the engines, close them with the cluster, list them in ``raydp status``."""
        # Held strongly, unlike the backend's listeners: API servers that serve keep their cluster, as a
        # client does. Their watch threads hold them weakly, so servers and cluster go once neither is held.
        servers.on_death(self._on_death)
        with self._lock:
            self._api_servers.append(servers)
        self._manager.register_api_servers(APIServerRecord(mode, servers.url, count, node_id, ranks))

    def _check_open(self) -> None:
        with self._lock:
            if self._closed:
                raise ClusterClosedError(f"cluster {self.name!r} is closed")

    def _on_death(self, err: ComponentDeadError) -> None:
        with self._lock:
            self._deaths.append(err)
            if isinstance(err, EngineDeadError):
                self._dead_ranks[err.rank] = err
            clients = self._live_clients()
        if isinstance(err, EngineDeadError):
            for client in clients:
                _tell(client.mark_dead, err)

    def _on_restart(self, endpoint: EngineEndpoint) -> None:
        with self._lock:
            self.endpoints = self.endpoints.with_engine(endpoint)
            self._dead_ranks.pop(endpoint.rank, None)
            clients = self._live_clients()
        for client in clients:
            _tell(client.revive, endpoint)

    def _on_coordinator_moved(self, endpoints: ClusterEndpoints) -> None:
        with self._lock:
            self.endpoints = msgspec.structs.replace(self.endpoints, coordinator=endpoints.coordinator)
            clients = self._live_clients()
        for client in clients:
            _tell(lambda c: c.follow_coordinator(endpoints.coordinator), client)

    def scale(self, dp_size: int, *, drain_timeout_s: float = 30.0, pool: str | None = None) -> None:
        """Grow or shrink the running cluster to ``dp_size`` ranks; returns once the change is done.

        Growing plans the new ranks on the nodes' free capacity now (or waits up
        to ``placement_timeout_s`` for nodes to join, where no allowlist pins
        the cluster), and clients route to them once they have joined.
        Shrinking removes the highest ranks: clients stop sending them new
        requests, what they hold drains for up to ``drain_timeout_s``, and
        requests still on them after that fail with
        :class:`~raydp.errors.ScaleDownError`. In lockstep mode the DP group
        is re-formed at a wave boundary; requests arriving meanwhile wait.
        Raises :class:`~raydp.errors.PlacementError` if the new ranks cannot
        be placed; on any failure the cluster serves on at its old size.

        A P/D cluster scales one pool at a time: ``pool`` ("prefill" or
        "decode") gets ``dp_size`` ranks and the other pool keeps its size
        (see :mod:`raydp.orchestration.pools`: a rank may switch pools, and
        what it runs finishes there).
        """
        check_scale_args(dp_size, drain_timeout_s)
        self._check_open()
        plan(self.endpoints.prefill_ranks, self.dp_size, pool, dp_size)  # a bad pool fails here, not in the supervisor
        self._manager.scale(dp_size, float(drain_timeout_s), pool)

    def _on_scale(self, endpoints: ClusterEndpoints, size: int, drain_timeout_s: float | None) -> None:
        with self._lock:
            self.endpoints = endpoints
            for rank in [r for r in self._dead_ranks if r >= len(endpoints.engines)]:
                del self._dead_ranks[rank]
            clients = self._live_clients()
        for client in clients:
            _tell(lambda c: c.rescale(endpoints, size, drain_timeout_s), client)

    def _live_clients(self) -> list[Client]:
        """Clients still open (callers hold the lock); closed ones are forgotten here."""
        self._clients[:] = [c for c in self._clients if not c.closed]
        self._closers[:] = [c.closer for c in self._clients]
        return list(self._clients)

    def wait(self, timeout: float | None = None, *, degraded_ok: bool = False) -> None:
        """Block until a component dies for good, then raise its error; Ctrl-C closes the cluster.

        Deaths the restart policy recovers from do not end the wait (they are
        listed in :attr:`deaths`). With ``degraded_ok`` (how ``raydp serve``
        waits) a rank that is down for good does not end it either while
        another rank lives: the wait ends when the last rank is down, or the
        coordinator or an API server is. Returns None if ``timeout`` passes.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                with self._lock:
                    final, closed = self._ending(degraded_ok), self._closed
                if final:
                    raise final[0]
                left = WAIT_POLL_S if deadline is None else min(WAIT_POLL_S, deadline - time.monotonic())
                if closed or left <= 0:
                    return
                # A sleep, not Condition.wait: Ctrl-C (or raydp serve's stop signal) raised while
                # Condition.wait re-acquires its lock leaves the lock released under a `with` that then
                # fails with "release unlocked lock" instead of stopping.
                time.sleep(left)
        except KeyboardInterrupt:
            self.close()
            raise

    def _ending(self, degraded_ok: bool) -> list[ComponentDeadError]:
        """The final deaths that end a wait (each one, or with ``degraded_ok`` those of all ranks or of others)."""
        final = self._final_deaths()
        if not degraded_ok:
            return final
        ranks: list[ComponentDeadError] = [e for e in final if isinstance(e, EngineDeadError)]
        others = [e for e in final if not isinstance(e, EngineDeadError)]
        down = {e.rank for e in final if isinstance(e, EngineDeadError)}
        return others or (ranks[-1:] if len(down) >= self.dp_size else [])

    def _final_deaths(self) -> list[ComponentDeadError]:
        return [e for e in self._deaths if not getattr(e, "restarting", False)]

    @property
    def deaths(self) -> list[ComponentDeadError]:
        with self._lock:
            return list(self._deaths)

    def coordinator_state(self) -> CoordinatorStatus:
        """The coordinator's wave, running flag, counts and counters (for tests and operators)."""
        return self._manager.coordinator_state()

    def close(self) -> None:
        """Close every client, then (if this handle launched them) the actors and groups."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients = list(self._clients)
            self._clients.clear()
            self._closers.clear()
            servers, self._api_servers = self._api_servers, []
        for server in servers:
            server.close()
        for client in clients:
            client.close()
        self._manager.close()

    def shutdown(self) -> None:
        """Close this handle and end the cluster itself, even one launched elsewhere."""
        self.close()
        if self._terminate is not None:
            self._terminate()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_scale_args(dp_size: object, drain_timeout_s: object) -> None:
    """Validation shared by :meth:`Cluster.scale` and ``raydp scale``."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ConfigError(f"dp_size={dp_size!r}: must be an int >= 1")
    if isinstance(drain_timeout_s, bool) or not isinstance(drain_timeout_s, int | float) or drain_timeout_s < 0:
        raise ConfigError(f"drain_timeout_s={drain_timeout_s!r}: must be a number >= 0")


def _tell(notify: Any, arg: Any) -> None:
    """One client failing to take a notice must not keep it from the others."""
    try:
        notify(arg)
    except Exception:
        logger.exception("could not pass %r to a client", arg)
