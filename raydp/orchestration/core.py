"""The :class:`Orchestrator`: one cluster's control sequences, over a :class:`~raydp.orchestration.runtime.Runtime`.

It owns the rank table and what startup learned (the coordinator's
addresses, the DP rendezvous, the endpoints), runs the startup sequence, and
routes each death to its policy: a dense rank restarts alone
(:mod:`~raydp.orchestration.restart`), a lockstep gang restarts whole
(:mod:`~raydp.orchestration.gang`), the coordinator restarts at its addresses
(:mod:`~raydp.orchestration.coordinator_restart`). Scale changes are
:mod:`~raydp.orchestration.scaling`. Nothing here knows which process it runs
in or what runs the engines: deaths come in through :meth:`report`, every
action goes out through the runtime.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from raydp.backend import DeathReports, OwnedResources, ScaleListener
from raydp.config import RaydpConfig
from raydp.coordinator.client import CoordinatorClient
from raydp.errors import ClusterClosedError, ConfigError, DeathCause
from raydp.orchestration.coordinator_restart import CoordinatorRestarts
from raydp.orchestration.gang import GangRestarts
from raydp.orchestration.ranks import RankRecord, RankTable
from raydp.orchestration.restart import DenseRestarts
from raydp.orchestration.runtime import Progress, Runtime
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.handshake import HandshakeResult, parallel_config
from raydp.wire.protocol import EngineAddresses, Init
from raydp.wire.security import CurveKeys
from raydp.wire.transport import pick_address

logger = logging.getLogger("raydp.manager")


class Orchestrator:
    """Start, restart and scale one cluster; see the module docstring.

    ``report`` takes every death (rank -1: the coordinator) from the runtime's
    watchers; callers of the sequences hold nothing. ``threads`` collects the
    restart threads, for the backend's close to join.
    """

    def __init__(
        self,
        config: RaydpConfig,
        runtime: Runtime,
        owned: OwnedResources,
        *,
        driver_node_id: str,
        ipc_prefix: str,
        sock_opts: Any,
        curve: CurveKeys | None = None,
        table: RankTable | None = None,
        threads: list[threading.Thread] | None = None,
        control: Callable[[CoordinatorEndpoints], CoordinatorClient] | None = None,
    ) -> None:
        self.config = config
        self.rt = runtime
        self.owned = owned
        self.driver_node_id = driver_node_id
        self.ipc_prefix = ipc_prefix
        self.sock_opts = sock_opts
        self.curve = curve
        self.table = table if table is not None else RankTable()
        self.reports = DeathReports()
        self.threads: list[threading.Thread] = threads if threads is not None else []
        self.control = control or self.coordinator_client  # how this process tells the coordinator things
        self.report_lock = threading.RLock()  # the watchers and the restart threads all report
        self.place_lock = threading.Lock()  # two re-placed ranks must not plan onto the same free devices
        self.scale_lock = threading.Lock()
        self.scale_listeners: list[ScaleListener] = []
        self.endpoints: ClusterEndpoints | None = None
        self.coordinator_endpoints: CoordinatorEndpoints | None = None
        self.dp_master = ""
        self.dp_size = config.dp_size  # what a rank's INIT says: the size now (a scale change moves it)
        self.wave = 0  # the wave a rank joining a running lockstep cluster starts in
        self.dense = DenseRestarts(self, config)
        self.gang = GangRestarts(self, config.max_restarts if runtime.restarts_gangs else 0)
        self.coordinator_restarts = CoordinatorRestarts(
            self, config.coordinator_max_restarts if runtime.restarts_coordinator else 0
        )

    # ---- startup ------------------------------------------------------------------------

    def start(self, progress: Progress | None = None) -> ClusterEndpoints:
        """Place, spawn, handshake, subscribe; the caller releases everything if this raises."""
        cfg, rt = self.config, self.rt
        records = rt.place(range(cfg.dp_size), (), "launch")
        self.table.extend(records)
        # Nothing waits on what it does not need: the coordinator, the device probes and
        # the ranks' processes (and their imports) all start side by side.
        probes = rt.probe_devices(records)
        rt.spawn_engines(records, probes, successors=False)
        self.coordinator_endpoints = rt.start_coordinator(cfg.dp_size, None)
        self.dp_master = rt.dp_master(cfg.dp_size, records) if cfg.lockstep else ""
        result = rt.join(records, self.init_for, progress)
        for record, devices in zip(records, rt.resolve_devices(probes), strict=True):
            record.devices = devices
        if not rt.wait_subscribed(cfg.dp_size, None, records):
            raise TimeoutError("engines did not subscribe to the coordinator's broadcast in time")
        self.endpoints = self.cluster_endpoints(result)
        rt.publish(self.endpoints, handed=True)
        self.reports.coordinator = self.control(self.coordinator_endpoints)
        self.owned.closers.append(self.reports.coordinator.close)
        self.dense.budget.grant(self.table.ranks())
        rt.watch(records)
        if cfg.autoscaling is not None:
            from raydp.orchestration.autoscaling import Autoscaler

            Autoscaler(self, cfg.autoscaling).start()
        return self.endpoints

    def coordinator_client(self, endpoints: CoordinatorEndpoints) -> CoordinatorClient:
        return CoordinatorClient(endpoints, self.driver_node_id, self.sock_opts)

    def init_for(self, rank: int) -> Init:
        """What rank ``rank`` is told in its handshake: the coordinator's addresses, its DP group."""
        coord = self.coordinator_endpoints
        assert coord is not None
        same = self.table[rank].node_id == coord.node_id
        return Init(
            EngineAddresses(pick_address(coord.collect, same_node=same), pick_address(coord.broadcast, same_node=same)),
            parallel_config(self.config, self.dp_master, self.dp_size, self.wave),
        )

    def cluster_endpoints(self, result: HandshakeResult) -> ClusterEndpoints:
        assert self.coordinator_endpoints is not None
        engines = [EngineEndpoint(r.rank, r.node_id, result.ready[r.rank].input_addresses) for r in self.table]
        return ClusterEndpoints(
            self.config.name,
            engines,
            self.coordinator_endpoints,
            self.config.lockstep,
            self.table.capacity(self.table.ranks()),
            self.ipc_prefix,
            self.config.heartbeat_interval_s,
            self.curve,
        )

    # ---- deaths and restarts ------------------------------------------------------------

    def report(self, rank: int, cause: DeathCause, detail: str) -> None:
        """A rank (or, at -1, the coordinator) ended: report it and apply the restart policy."""
        with self.report_lock:
            if rank < 0:
                self.coordinator_restarts.on_death(cause, detail)
            elif self.config.lockstep:
                self.gang.on_death(rank, cause, detail)
            else:
                self.dense.on_death(rank, cause, detail)

    def closing(self) -> bool:
        return self.owned.stop.is_set()

    def in_background(self, name: str, target: Callable[..., None], *args: Any) -> None:
        """Run a restart on a thread of its own, joined by the backend's close."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def publish_restart(self, records: Sequence[RankRecord], result: HandshakeResult) -> None:
        """Restarted ranks rejoined: new endpoints everywhere, watched from now on."""
        assert self.endpoints is not None
        for record in records:
            record.restarts += 1
            endpoint = EngineEndpoint(record.rank, record.node_id, result.ready[record.rank].input_addresses)
            self.endpoints = self.endpoints.with_engine(endpoint)
        self.rt.publish(self.endpoints, handed=False)
        self.rt.watch(records)
        for record in records:
            self.reports.revived(self.endpoints.engines[record.rank])

    def kill_ranks(self, except_rank: int) -> None:
        """A broken collective would hold the surviving ranks forever: end them now."""
        self.rt.kill([r for r in self.table if r.rank != except_rank])

    # ---- scaling ------------------------------------------------------------------------

    def scale(self, dp_size: int, drain_timeout_s: float) -> ClusterEndpoints:
        """Grow or shrink to ``dp_size`` ranks (see :mod:`raydp.orchestration.scaling`); one change at a time."""
        from raydp.orchestration.scaling import ScaleChange

        if not self.scale_lock.acquire(blocking=False):
            raise ConfigError(f"dp_size={dp_size}: another scale of cluster {self.config.name!r} is running")
        try:
            if self.closing() or self.endpoints is None:
                raise ClusterClosedError(f"cluster {self.config.name!r} is closed")
            return ScaleChange(self, dp_size, drain_timeout_s).run()
        finally:
            self.scale_lock.release()

    def publish_scale(self, engines: list[EngineEndpoint], size: int, drain_timeout_s: float | None) -> None:
        """New endpoints for this process, the cluster's record (for ``attach``) and every listener."""
        assert self.endpoints is not None
        self.endpoints = self.endpoints.with_engines(engines, self.table.capacity(e.rank for e in engines))
        self.rt.publish(self.endpoints, handed=False)
        for listener in list(self.scale_listeners):
            try:
                listener(self.endpoints, size, drain_timeout_s)
            except Exception:
                logger.exception("scale listener failed")


def weak_report(orchestrator: Orchestrator) -> Callable[[int, DeathCause, str], None]:
    """``orchestrator.report`` held weakly, for watcher threads: they must not keep a cluster alive
    (dropping the last handle of a cluster closes it)."""
    report = weakref.WeakMethod(orchestrator.report)

    def report_if_alive(rank: int, cause: DeathCause, detail: str) -> None:
        method = report()
        if method is not None:
            method(rank, cause, detail)

    return report_if_alive
