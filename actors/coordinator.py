"""``CoordinatorActor``: the named Ray actor that hosts one cluster's coordinator."""

from __future__ import annotations

import threading
import time

import msgspec
import ray

from raydp.actors.metrics import CoordinatorMetrics, export_periodically
from raydp.config import RaydpConfig, TransportKind
from raydp.coordinator.loop import CoordinatorLoop
from raydp.coordinator.resync import Restored
from raydp.coordinator.state import CoordinatorState
from raydp.logs import configure_component_logging
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints
from raydp.wire.records import APIServerRecord, AutoscaleDecision, ClusterInfo, CoordinatorStatus, LaunchRecord
from raydp.wire.transport import SocketOptions


class CoordinatorActor:
    """Tracks per-rank load and waves for one cluster; the data path is ZMQ (:mod:`raydp.coordinator.loop`).

    Methods (Ray, control only):

    * ``endpoints()`` -> the publish, collect and broadcast socket addresses;
    * ``run()`` serves until ``shutdown()``;
    * ``wait_for_engines(n, timeout_s)`` -> True once ``n`` engines subscribed;
      ``wait_for_rank(rank, timeout_s)`` -> True once that one has (a restarted rank);
    * ``set_cluster(endpoints, info, launch)`` / ``cluster()`` -> the cluster's endpoints, for
      ``raydp.attach``; ``config()`` -> its config; ``launch()`` -> its config and engine class,
      for ``raydp scale`` (records: :mod:`raydp.wire.records`);
    * ``add_api_servers(record)`` / ``info()`` -> devices per rank and API servers, for ``raydp status``;
    * ``state()`` -> wave, running flag, counts, dead ranks, dropped/broadcast counters;
    * ``shutdown()`` broadcasts Shutdown to engines and closes every socket.

    States: serving -> closed. While serving, a thread exports per-rank load,
    deaths, restarts and the wave as Ray metrics (``raydp_rank_*``, ``raydp_wave``).

    Failures: malformed socket input, and messages naming unknown ranks, are
    logged and dropped; they never kill the actor. If the actor dies, the
    manager sees its ``run`` ref finish, reports ``CoordinatorDeadError`` and
    starts a successor (``successor_of``: the dead one's addresses and what the
    launcher knows, :class:`~raydp.coordinator.resync.Restored`) on the same
    node; it binds the same addresses, so engines and clients reconnect on
    their own, and rebuilds loads and the wave from the engines' reports
    (:mod:`raydp.coordinator.resync`). Meanwhile dense ranks keep serving on
    the clients' last snapshot, and lockstep ranks keep stepping the wave
    they are in. If its node died, the successor (``rebind=False``) binds new
    addresses on a live node, and the engines and clients are told to follow.
    """

    def __init__(
        self,
        engine_count: int,
        stats_interval_s: float,
        heartbeat_interval_s: float,
        transport: TransportKind,
        options: SocketOptions,
        cluster_name: str,
        ipc_prefix: str = "",
        successor_of: tuple[CoordinatorEndpoints, Restored] | None = None,
        rebind: bool = True,
    ) -> None:
        configure_component_logging(f"{cluster_name} coordinator")
        state = CoordinatorState(engine_count, stats_interval_s, heartbeat_interval_s)
        if successor_of is not None:
            state.restore(successor_of[1], time.monotonic())
        self._loop = CoordinatorLoop(
            state,
            options,
            transport=transport,
            node_id=ray.get_runtime_context().get_node_id(),
            ipc_prefix=f"{ipc_prefix or cluster_name}-coordinator",
            rebind=successor_of[0] if successor_of is not None and rebind else None,
        )
        self._cluster: ClusterEndpoints | None = None
        self._info = ClusterInfo()
        self._launch: LaunchRecord | None = None
        self._api_servers: list[APIServerRecord] = []
        self._metrics_stop = threading.Event()
        self._autoscale: AutoscaleDecision | None = None
        self._prefill_autoscale: AutoscaleDecision | None = None  # P/D: the prefill pool's autoscaler
        self._metrics = CoordinatorMetrics(cluster_name)
        export_periodically(self._loop.describe, self._metrics.export, self._metrics_stop)

    def endpoints(self) -> CoordinatorEndpoints:
        return self._loop.endpoints

    def run(self) -> None:
        self._loop.run()

    def wait_for_engines(self, engine_count: int, timeout_s: float) -> bool:
        return self._loop.wait_for_engines(engine_count, timeout_s)

    def wait_for_rank(self, rank: int, timeout_s: float) -> bool:
        return self._loop.wait_for_rank(rank, timeout_s)

    def set_cluster(
        self, endpoints: ClusterEndpoints, info: ClusterInfo | None = None, launch: LaunchRecord | None = None
    ) -> None:
        self._cluster = endpoints
        if info is not None:
            self._info = info
        if launch is not None:
            self._launch = launch

    def cluster(self) -> ClusterEndpoints | None:
        return self._cluster

    def launch(self) -> LaunchRecord | None:
        """How the cluster was launched (config, engine class), for a process that scales it later."""
        return self._launch

    def config(self) -> RaydpConfig | None:
        """The cluster's config alone: an attaching process need not import the engine class."""
        return self._launch.config if self._launch is not None else None

    def add_api_servers(self, record: APIServerRecord) -> None:
        self._api_servers.append(record)

    def set_autoscale(self, decision: AutoscaleDecision) -> None:
        """An autoscaler's latest decision, for ``raydp status`` and the metrics."""
        if decision.pool == "prefill":
            self._prefill_autoscale = decision
        else:
            self._autoscale = decision
        self._metrics.export_autoscale(decision)

    def info(self) -> ClusterInfo:
        """What ``raydp status`` shows beyond the state: devices per rank, API servers."""
        return msgspec.structs.replace(
            self._info,
            api_servers=list(self._api_servers),
            autoscale=self._autoscale,
            prefill_autoscale=self._prefill_autoscale,
        )

    def state(self) -> CoordinatorStatus:
        return self._loop.describe()

    def shutdown(self) -> None:
        self._metrics_stop.set()
        self._loop.close()  # waits for run() to close its own sockets
