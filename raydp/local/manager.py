"""``ProcessManager``: the multiprocessing backend, engines and coordinator as local processes.

For runs without a Ray cluster, on one node. It implements
:class:`~raydp.backend.Backend` like the Ray ``ActorManager``, so
:class:`~raydp.cluster.Cluster` works unchanged, and runs the same control
sequences (:class:`~raydp.orchestration.core.Orchestrator`) over a
:class:`~raydp.local.runtime.ProcessRuntime`: the same handshake, the same
sockets, liveness from process sentinels (:mod:`raydp.processes`).

In dense mode a dead rank is started again while ``max_restarts`` allows: a
new process, handshaken alone, announced to the coordinator and the
launcher's clients as the Ray backend does. It scales up and down like the
Ray backend, on this node. In lockstep mode a death stops the gang, whose
collective is broken. The coordinator is not restarted.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from raydp.backend import APIServerGroup, APIServerSpec, DeathListener, MovedListener, RestartListener, ScaleListener
from raydp.config import RaydpConfig
from raydp.errors import ComponentDeadError, ConfigError
from raydp.local.children import LOCAL_NODE
from raydp.local.runtime import LocalOwned, ProcessRuntime
from raydp.orchestration.core import Orchestrator, weak_report
from raydp.orchestration.ranks import RankTable
from raydp.processes import Proc
from raydp.wire.endpoints import ClusterEndpoints
from raydp.wire.records import APIServerRecord, CoordinatorStatus
from raydp.wire.transport import ipc_prefix, socket_options

__all__ = ["LOCAL_NODE", "ProcessManager"]


class ProcessManager:
    """Engines (and the coordinator) as spawned local processes; see the module docstring."""

    def __init__(self, config: RaydpConfig, *, progress: Callable[[int, int], None] | None = None) -> None:
        if config.transport == "tcp":
            raise ConfigError("transport='tcp': the mp backend runs on one node; use 'auto' or 'ipc'")
        # Every party is on this node: "auto" means IPC only, no TCP listeners.
        config = config.with_changes(transport="ipc")
        self.config = config
        self._progress = progress
        self.ipc_prefix = ipc_prefix(config.name)
        self._owned = LocalOwned(name=self.ipc_prefix)
        weakref.finalize(self, self._owned.collected)  # at garbage collection and at exit
        table = RankTable()
        self.runtime = ProcessRuntime(config, self._owned, table, ipc_prefix=self.ipc_prefix)
        self.orchestrator = Orchestrator(
            config,
            self.runtime,
            self._owned,
            driver_node_id=LOCAL_NODE,
            ipc_prefix=self.ipc_prefix,
            sock_opts=socket_options(config),
            table=table,
        )
        self.runtime.report = weak_report(self.orchestrator)
        self.runtime.report_process = self.orchestrator.reports.died

    @property
    def procs(self) -> tuple[Proc, ...]:
        return tuple(self._owned.procs)

    @property
    def deaths(self) -> list[ComponentDeadError]:
        return list(self.orchestrator.reports.deaths)

    @property
    def dp_size(self) -> int:
        return len(self.orchestrator.table)

    def on_death(self, listener: DeathListener) -> None:
        self.orchestrator.reports.on_death(listener)

    def on_restart(self, listener: RestartListener) -> None:
        self.orchestrator.reports.on_restart(listener)

    def on_coordinator_moved(self, listener: MovedListener) -> None:
        """Never called: this backend's coordinator is not restarted."""

    def on_scale(self, listener: ScaleListener) -> None:
        self.orchestrator.scale_listeners.append(listener)

    def register_api_servers(self, record: APIServerRecord) -> None:
        """``raydp status`` reads Ray clusters only: a local cluster keeps no registry."""

    def start_api_servers(self, spec: APIServerSpec) -> APIServerGroup:
        """Every rank is on this machine: local processes, on loopback."""
        from raydp.serve.processes import APIServerProcessManager

        return APIServerProcessManager(
            spec.endpoints, spec.count, port=spec.port, node_id=spec.node_id, ranks=spec.ranks, settings=spec.settings
        )

    def start(self) -> ClusterEndpoints:
        try:
            return self.orchestrator.start(self._progress)
        except BaseException:
            self.close()
            raise

    def coordinator_state(self) -> CoordinatorStatus:
        return self.runtime.coordinator_state()

    def scale(self, dp_size: int, drain_timeout_s: float, pool: str | None = None) -> ClusterEndpoints:
        """Grow or shrink to ``dp_size`` local ranks, or ``pool`` to ``dp_size`` (see the orchestrator)."""
        return self.orchestrator.scale(dp_size, drain_timeout_s, pool)

    def close(self) -> None:
        self._owned.release()
