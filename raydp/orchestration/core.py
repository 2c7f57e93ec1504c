"""The :class:`Orchestrator`: one cluster's control sequences, over a :class:`~raydp.orchestration.runtime.Runtime`.

It builds the cluster's :class:`~raydp.orchestration.state.ClusterState`
(the rank table and the shared facts, changed only through its transitions)
and the :class:`~raydp.orchestration.controls.Controls` every policy gets,
runs the startup sequence, and routes each death to its policy: a dense rank restarts alone
(:mod:`~raydp.orchestration.restart`), a lockstep gang restarts whole
(:mod:`~raydp.orchestration.gang`), the coordinator restarts at its addresses
(:mod:`~raydp.orchestration.coordinator_restart`). Scale changes are
:mod:`~raydp.orchestration.scaling`. Nothing here knows which process it runs
in or what runs the engines: deaths come in through :meth:`report`, every
action goes out through the runtime.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from raydp.backend import ScaleListener
from raydp.config import RaydpConfig
from raydp.coordinator.client import CoordinatorClient
from raydp.errors import ClusterClosedError, ConfigError, DeathCause
from raydp.orchestration.budget import RestartBudget
from raydp.orchestration.controls import Controls
from raydp.orchestration.coordinator_restart import CoordinatorRestarts
from raydp.orchestration.gang import GangRestarts
from raydp.orchestration.owned import OwnedResources
from raydp.orchestration.ranks import RankTable
from raydp.orchestration.reports import DeathReports
from raydp.orchestration.restart import DenseRestarts
from raydp.orchestration.runtime import Progress, Runtime
from raydp.orchestration.state import ClusterState
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.handshake import HandshakeResult
from raydp.wire.security import CurveKeys

logger = logging.getLogger("raydp.manager")


class Orchestrator:
    """Start, restart and scale one cluster; see the module docstring.

    ``report`` takes every death (rank -1: the coordinator) from the runtime's
    watchers; callers of the sequences hold nothing. ``threads`` collects the
    restart threads, for the Ray backend's close to join (the ``mp`` backend
    passes none: its close ends processes under the lock they take). The policies get
    :attr:`controls`, never the orchestrator.
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
        self.driver_node_id = driver_node_id
        self.ipc_prefix = ipc_prefix
        self.sock_opts = sock_opts
        self.curve = curve
        self.state = ClusterState(config.dp_size, table)
        self.controls = Controls(
            config,
            runtime,
            self.state,
            owned,
            report=self.report,
            control=control or self.coordinator_client,  # how this process tells the coordinator things
            budget=RestartBudget(
                config.max_restarts,
                window_s=config.restart_window_s,
                backoff_s=config.restart_backoff_s,
                backoff_max_s=config.restart_backoff_max_s,
            ),
            threads=threads if threads is not None else [],
        )
        self.scale_lock = threading.Lock()
        self.tickers: list[object] = []  # the autoscalers and the silence watch: their threads hold them weakly
        self.dense = DenseRestarts(self.controls)
        self.gang = GangRestarts(self.controls, config.max_restarts if runtime.restarts_gangs else 0)
        self.coordinator_restarts = CoordinatorRestarts(
            self.controls, config.coordinator_max_restarts if runtime.restarts_coordinator else 0
        )

    @property
    def table(self) -> RankTable:
        return self.state.table

    @property
    def reports(self) -> DeathReports:
        return self.controls.reports

    @property
    def endpoints(self) -> ClusterEndpoints | None:
        return self.state.endpoints

    @property
    def scale_listeners(self) -> list[ScaleListener]:
        return self.controls.scale_listeners

    # ---- startup ------------------------------------------------------------------------

    def start(self, progress: Progress | None = None) -> ClusterEndpoints:
        """Place, spawn, handshake, subscribe; the caller releases everything if this raises."""
        cfg, rt, state, controls = self.config, self.rt, self.state, self.controls
        records = rt.place(range(cfg.dp_size), (), "launch")
        state.launched(records)
        # Nothing waits on what it does not need: the coordinator, the device probes and
        # the ranks' processes (and their imports) all start side by side.
        probes = rt.probe_devices(records)
        rt.spawn_engines(records, probes, successors=False)
        coordinator = rt.start_coordinator(cfg.dp_size, None)
        state.coordinator_started(coordinator)
        state.rendezvous_at(rt.dp_master(cfg.dp_size, records) if cfg.lockstep else "")
        result = rt.join(records, controls.init_for, progress)
        for record, devices in zip(records, rt.resolve_devices(probes), strict=True):
            record.devices = devices
        if not rt.wait_subscribed(cfg.dp_size, None, records):
            raise TimeoutError("engines did not subscribe to the coordinator's broadcast in time")
        state.serving(self.cluster_endpoints(coordinator, result))
        assert state.endpoints is not None
        rt.publish(state.endpoints, handed=True)
        self.reports.coordinator = controls.control(coordinator)
        controls.owned.closers.append(self.reports.coordinator.close)
        controls.budget.grant(state.table.ranks())
        rt.watch(records)
        self.start_autoscalers()
        self.start_silence_watch()
        return state.endpoints

    def start_silence_watch(self) -> None:
        """Ends ranks frozen whole (:mod:`~raydp.orchestration.silence`), unless nothing bounds their silence."""
        from raydp.orchestration.silence import SilenceWatch

        bound = self.config.silence_bound_s
        if bound is not None:
            watch = SilenceWatch(self.controls, bound, self.scale_lock)
            self.tickers.append(watch)
            watch.start()

    def start_autoscalers(self) -> None:
        """One per autoscaled pool (the whole cluster where it has none); they take turns at scaling."""
        from raydp.orchestration.autoscaling import Autoscaler

        cfg, scale, busy = self.config, functools.partial(self.scale, wait=True), self.scale_lock.locked
        pools = [(cfg.autoscaling, "decode" if cfg.pooled else None), (cfg.prefill_autoscaling, "prefill")]
        for config, pool in pools:
            if config is not None:
                autoscaler = Autoscaler(self.controls, scale, config, pool, busy)
                self.tickers.append(autoscaler)
                autoscaler.start()

    def coordinator_client(self, endpoints: CoordinatorEndpoints) -> CoordinatorClient:
        return CoordinatorClient(endpoints, self.driver_node_id, self.sock_opts)

    def cluster_endpoints(self, coordinator: CoordinatorEndpoints, result: HandshakeResult) -> ClusterEndpoints:
        table = self.state.table
        engines = [EngineEndpoint(r.rank, r.node_id, result.ready[r.rank].input_addresses) for r in table]
        return ClusterEndpoints(
            self.config.name,
            engines,
            coordinator,
            self.config.lockstep,
            table.capacity(table.ranks()),
            self.ipc_prefix,
            self.config.heartbeat_interval_s,
            self.curve,
            self.config.prefill_dp_size,
        )

    # ---- deaths and restarts ------------------------------------------------------------

    def report(self, rank: int, cause: DeathCause, detail: str) -> None:
        """A rank (or, at -1, the coordinator) ended: report it and apply the restart policy."""
        with self.controls.report_lock:
            if rank >= 0:
                cause, detail = self.controls.cause_of_end(rank, cause, detail)  # a frozen rank's kill: its hang
            if rank < 0:
                self.coordinator_restarts.on_death(cause, detail)
            elif self.config.lockstep:
                self.gang.on_death(rank, cause, detail)
            else:
                self.dense.on_death(rank, cause, detail)

    # ---- scaling ------------------------------------------------------------------------

    def scale(
        self, dp_size: int, drain_timeout_s: float, pool: str | None = None, *, wait: bool = False
    ) -> ClusterEndpoints:
        """Grow or shrink to ``dp_size`` ranks, or a P/D cluster's ``pool`` to ``dp_size`` ranks (see
        :mod:`raydp.orchestration.scaling` and :mod:`raydp.orchestration.pools`); one change at a time.

        Another change running: ConfigError, unless ``wait`` (the autoscalers
        wait their turn; the sizes are planned once the lock is held).
        """
        from raydp.orchestration.pools import plan
        from raydp.orchestration.scaling import ScaleChange

        if pool == "prefill" and self.config.pools_differ:
            raise ConfigError(
                f"pool='prefill': the prefill pool grows and shrinks by trading ranks with the decode pool, but "
                f"its ranks shard over {self.config.prefill_tensor_parallel_size} devices and the decode ranks "
                f"over {self.config.tensor_parallel_size}; it keeps its {self.config.prefill_dp_size} ranks"
            )
        if not self.scale_lock.acquire(blocking=wait):
            raise ConfigError(f"dp_size={dp_size}: another scale of cluster {self.config.name!r} is running")
        try:
            if self.controls.closing() or self.state.endpoints is None:
                raise ClusterClosedError(f"cluster {self.config.name!r} is closed")
            target = plan(self.state.prefill_ranks, self.state.dp_size, pool, dp_size)
            return ScaleChange(self.controls, target.dp_size, drain_timeout_s, target.prefill).run()
        finally:
            self.scale_lock.release()


def weak_report(orchestrator: Orchestrator) -> Callable[[int, DeathCause, str], None]:
    """``orchestrator.report`` held weakly, for watcher threads: they must not keep a cluster alive
    (dropping the last handle of a cluster closes it)."""
    report = weakref.WeakMethod(orchestrator.report)

    def report_if_alive(rank: int, cause: DeathCause, detail: str) -> None:
        method = report()
        if method is not None:
            method(rank, cause, detail)

    return report_if_alive
