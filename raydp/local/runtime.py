"""``ProcessRuntime``: the orchestration :class:`~raydp.orchestration.runtime.Runtime` over local processes.

Every rank is a spawned process on this node (:mod:`raydp.local.children`),
the coordinator another, driven over a msgpack control pipe. A rank's
process is spawned when it joins (it gets the handshake's addresses as an
argument), each rank is watched by a thread of its own through its process
sentinel and death pipe, and the parent hosts lockstep rendezvous (it
outlives every rank, and binding here leaves no race). It restarts dense
ranks and scales; a broken lockstep gang stops, and a dead coordinator is
reported, not restarted.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from raydp.config import RaydpConfig
from raydp.coordinator.resync import Restored
from raydp.engine.core import load_engine_class, preload_modules
from raydp.errors import DeathCause, ProcessDeadError, StartupError, describe_exit
from raydp.fork_server import child_context
from raydp.local.children import LOCAL_NODE, coordinator_main, decode_death, engine_main
from raydp.local.control import ControlPipe, recv
from raydp.local.executor import check_device_count, rank_device_ids
from raydp.names import coordinator_name, rank_name
from raydp.orchestration.owned import OwnedResources
from raydp.orchestration.ranks import RankRecord, RankTable
from raydp.orchestration.runtime import InitFor, Progress, join_ranks
from raydp.processes import Proc, end_orphan, last_words, shutdown, spawn, watch_processes
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints
from raydp.wire.handshake import HandshakeResult, HandshakeServer
from raydp.wire.records import AutoscaleDecision, CoordinatorStatus
from raydp.wire.transport import IpcDir, remove_cluster_ipc_dirs, socket_options

logger = logging.getLogger("raydp.local")
CONTROL_TIMEOUT_S = 30.0
STOP_GRACE_S = 3.0
Report = Callable[[int, DeathCause, str], None]


@dataclass
class LocalOwned(OwnedResources):
    """The processes of one local launch, and the coordinator's control pipe."""

    procs: list[Proc] = field(default_factory=list)
    control: ControlPipe | None = None
    # One ending at a time (close's included): two threads ending the same process (the silence
    # watch's kill, a restart's, a stays-down end) would close its pipes twice, one fd closed twice.
    ending: threading.RLock = field(default_factory=threading.RLock)

    def stop_components(self) -> None:
        if self.control is not None:
            self.control.stop()
        with self.ending:
            shutdown(list(self.procs))
        if self.name:
            remove_cluster_ipc_dirs(self.name)
        if self.control is not None:
            self.control.close()


class ProcessRuntime:
    """Local processes for one cluster; see the module docstring."""

    restarts_gangs = False
    restarts_coordinator = False

    def __init__(self, config: RaydpConfig, owned: LocalOwned, table: RankTable, *, ipc_prefix: str) -> None:
        self.config = config
        self.owned = owned
        self.table = table
        self.stop = owned.stop
        self.ipc_prefix = ipc_prefix
        self.sock_opts = socket_options(config)
        self.mp = child_context(preload_modules(load_engine_class(config.engine)))
        self.report: Report | None = None  # set by the backend: where rank deaths go
        self.report_process: Callable[[ProcessDeadError], None] | None = None  # the coordinator's: final
        self.retired: set[int] = set()  # ids of processes raydp ended: not deaths
        self.watchers: dict[int, threading.Thread] = {}
        self.coordinator: Proc | None = None
        self.autoscale: AutoscaleDecision | None = None
        self.prefill_autoscale: AutoscaleDecision | None = None  # P/D: the prefill pool's autoscaler

    # ---- placement: every rank on this node -----------------------------------------------

    def place(self, ranks: range, existing: Sequence[RankRecord], why: str) -> list[RankRecord]:
        return [RankRecord(rank, LOCAL_NODE, rank, owns_group=False) for rank in ranks]

    def remove_groups(self, records: Sequence[RankRecord]) -> None:
        """Nothing is reserved for a local rank."""

    def probe_devices(self, records: Sequence[RankRecord]) -> list[Any]:
        """This machine's devices, in rank order (each rank its pool's world size): a ConfigError, before
        any process, where too few."""
        cfg = self.config
        if records:
            top = max(r.rank for r in records)
            what = f"dp_size={top + 1} with world_size={cfg.world_size_of(top)} (devices per rank)"
            check_device_count(cfg.accelerator, cfg.devices_before(top + 1), what)
        return [rank_device_ids(cfg, r.rank) for r in records]

    def resolve_devices(self, probes: Sequence[Any]) -> list[tuple[str, ...]]:
        return [tuple(p) for p in probes]

    # ---- engines ----------------------------------------------------------------------------

    def spawn_engines(self, records: Sequence[RankRecord], devices: Sequence[Any], successors: bool) -> None:
        """A rank's process starts when it joins: it is handed the handshake's addresses."""

    def wait_built(self, records: Sequence[RankRecord]) -> None:
        """A local rank builds its engine inside the handshake."""

    def join(
        self,
        records: Sequence[RankRecord],
        init_for: InitFor,
        progress: Progress | None = None,
        watched: Sequence[RankRecord] = (),
    ) -> HandshakeResult:
        cfg, owned = self.config, self.owned
        if owned.ctx is None:
            owned.ctx = zmq.Context()
            owned.ipc_dir = IpcDir(f"{self.ipc_prefix}-frontend")
        server = HandshakeServer(owned.ctx, self.sock_opts, transport="ipc", ipc_dir=owned.ipc_dir)

        def start(addresses: list[str]) -> None:
            with owned.lock:  # close() must not miss a process started behind its back (a restart's)
                if owned.released:
                    raise StartupError(f"cluster {cfg.name!r} is closing")
                for record in records:
                    record.handle = record.run_ref = self._spawn(
                        rank_name(cfg.name, record.rank),
                        engine_main,
                        cfg,
                        record.rank,
                        addresses,
                        self.ipc_prefix,
                        rank=record.rank,
                    )

        return join_ranks(
            server, records, start, lambda r: True, init_for, cfg, lambda: self.check_alive(records), progress
        )

    def _spawn(
        self, name: str, target: Callable[..., None], *args: Any, rank: int | None = None, context: Any = None
    ) -> Proc:
        proc = spawn(context or self.mp, name, target, *args, rank=rank)
        self.owned.procs.append(proc)
        return proc

    def check_alive(self, records: Sequence[RankRecord]) -> None:
        """A join fails at once if close() began or one of its processes died."""
        if self.stop.is_set():
            raise StartupError(f"cluster {self.config.name!r} is closing")
        procs = [r.handle for r in records if r.handle is not None]
        starting = self.coordinator is not None and id(self.coordinator) not in self.watchers
        for proc in [*procs, *([self.coordinator] if starting else [])]:
            if not proc.process.is_alive():
                end_orphan(proc)
                words = decode_death(last_words(proc))
                why = f":\n{words.message}" if words else ""
                raise StartupError(f"{proc.name} died during startup ({proc.exit_text()}){why}")

    def kill(self, records: Sequence[RankRecord]) -> None:
        self._end([r.handle for r in records if r.handle is not None], grace_s=0.5)

    def stop_engines(self, records: Sequence[RankRecord]) -> None:
        self._end([r.handle for r in records if r.handle is not None], grace_s=STOP_GRACE_S)

    def _end(self, procs: list[Proc], grace_s: float) -> None:
        """Terminate, and let each watcher see the exit before the death pipes close."""
        with self.owned.ending:
            for proc in procs:
                if proc.process.is_alive():
                    proc.process.terminate()
            for proc in procs:
                proc.process.join(timeout=grace_s)
                watcher = self.watchers.pop(id(proc), None)
                if watcher is not None and watcher is not threading.current_thread():
                    watcher.join(timeout=1.0)
            shutdown(procs, grace_s=0.5)  # kills what is left, closes the pipes
            with self.owned.lock:
                self.owned.procs[:] = [p for p in self.owned.procs if p not in procs]

    def watch(self, records: Sequence[RankRecord]) -> None:
        if self.coordinator is not None and id(self.coordinator) not in self.watchers:
            self.watchers[id(self.coordinator)] = watch_processes(
                [self.coordinator], self.stop, self.on_exit, "raydp-proc-watcher-coordinator"
            )
        for record in records:
            proc = record.handle
            self.watchers[id(proc)] = watch_processes(
                [proc], self.stop, self.on_exit, f"raydp-proc-watcher-{record.rank}"
            )

    def retire(self, records: Sequence[RankRecord]) -> None:
        for record in records:
            if record.handle is not None:
                self.retired.add(id(record.handle))
            record.run_ref = None

    def on_exit(self, proc: Proc) -> None:
        """A watched process ended: the coordinator's death is final, a rank's goes to its policy."""
        if id(proc) in self.retired:
            return
        words = decode_death(last_words(proc)) if proc.rank is not None else None
        if words is None:
            proc.process.join(timeout=1)
        code = proc.exitcode
        if proc.rank is None:
            if self.report_process is not None:
                name = f"{proc.name} (pid {proc.process.pid})"
                self.report_process(ProcessDeadError(name, code, LOCAL_NODE, detail=proc.exit_text()))
        elif self.report is not None:
            if words is not None:  # it said why (e.g. one of its workers died), and is exiting now
                self.report(proc.rank, DeathCause(words.cause), f"{proc.name} pid {proc.process.pid}: {words.message}")
            else:
                detail = f"{proc.name} pid {proc.process.pid} {proc.exit_text()}"
                self.report(proc.rank, DeathCause.of_exit(code), detail)

    def in_flight(self, ranks: Sequence[int]) -> int:
        """What the coordinator last heard from the ranks: waiting plus running."""
        counts = self.coordinator_state().counts
        return sum(sum(counts[r]) for r in ranks if r < len(counts))

    def dp_master(self, size: int, watched: Sequence[RankRecord]) -> str:
        from raydp.engine.collective import Rendezvous

        rendezvous = Rendezvous("127.0.0.1", size)
        self.owned.closers.append(rendezvous.close)
        return rendezvous.address

    # ---- the coordinator --------------------------------------------------------------------

    def start_coordinator(
        self, size: int, successor_of: tuple[CoordinatorEndpoints, Restored] | None, moved: bool = False
    ) -> CoordinatorEndpoints:
        if successor_of is not None:
            raise StartupError("backend='mp' does not restart its coordinator")
        parent, child = self.mp.Pipe()
        # Spawned, never forked: it needs none of the engine's preload, and this backend cannot restart it,
        # so the fork server's death (which ends what it forked: raydp.processes) must not take it along.
        name = coordinator_name(self.config.name)
        proc = self._spawn(name, coordinator_main, self.config, self.ipc_prefix, child, context=mp.get_context("spawn"))
        self.coordinator = proc
        self.owned.control = ControlPipe(parent)
        if not parent.poll(self.config.component_start_s):
            raise StartupError(f"the coordinator did not start ({describe_exit(proc.process.exitcode)})")
        endpoints: CoordinatorEndpoints = recv(parent, CoordinatorEndpoints)
        return endpoints

    def follow_coordinator(self, records: Sequence[RankRecord], endpoints: CoordinatorEndpoints) -> list[int]:
        """Never asked: this backend's coordinator is not restarted."""
        return [r.rank for r in records]

    def kill_coordinator(self) -> None:
        if self.coordinator is not None:
            shutdown([self.coordinator], grace_s=0.5)

    def coordinator_state(self) -> CoordinatorStatus:
        return msgspec.convert(self.ask("state"), CoordinatorStatus)

    def wait_subscribed(self, count: int, rank: int | None, watched: Sequence[RankRecord]) -> bool:
        wait_s = self.config.handshake_timeout_s
        command = ("wait_for_engines", count) if rank is None else ("wait_for_rank", rank)
        return bool(self.ask(*command, wait_s, timeout_s=wait_s + CONTROL_TIMEOUT_S))

    def ask(self, *command: Any, timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
        if self.owned.control is None:
            raise StartupError("the coordinator process has not started")
        return self.owned.control.ask(*command, timeout_s=timeout_s)

    def record_autoscale(self, decision: AutoscaleDecision) -> None:
        """Kept for :attr:`autoscale` (:attr:`prefill_autoscale`) only: ``raydp status`` reads Ray clusters."""
        if decision.pool == "prefill":
            self.prefill_autoscale = decision
        else:
            self.autoscale = decision

    def publish(self, endpoints: ClusterEndpoints, handed: bool) -> None:
        """``raydp status`` reads Ray clusters only: a local cluster keeps no registry."""
