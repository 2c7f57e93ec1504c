"""``ProcessManager``: the multiprocessing backend, engines and coordinator as local processes.

For runs without a Ray cluster, on one node. It implements
:class:`~raydp.backend.Backend` like the Ray ``ActorManager``, so
:class:`~raydp.cluster.Cluster` works unchanged: the same handshake, the same
sockets, liveness from process sentinels (:mod:`raydp.processes`).

In dense mode a dead rank is started again while ``max_restarts`` allows: a
new process, handshaken alone, announced to the coordinator and the
launcher's clients as the Ray backend does. In lockstep mode a death stops
the gang, whose collective is broken. The coordinator is not restarted. It
is driven over a msgpack control pipe (no pickle crosses it either).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from raydp.backend import (
    APIServerGroup,
    DeathListener,
    DeathReports,
    OwnedResources,
    RestartBudget,
    RestartListener,
    ScaleListener,
)
from raydp.config import RaydpConfig
from raydp.coordinator.client import CoordinatorClient
from raydp.errors import (
    ComponentDeadError,
    ConfigError,
    DeathCause,
    EngineDeadError,
    ProcessDeadError,
    StartupError,
    describe_exit,
)
from raydp.names import coordinator_name, rank_name
from raydp.processes import (
    Proc,
    last_words,
    leave_last_words,
    on_stop_signals,
    set_process_title,
    shutdown,
    spawn,
    watch_parent,
    watch_processes,
)
from raydp.serve.settings import ServerSettings
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.handshake import HandshakeResult, HandshakeServer, parallel_config
from raydp.wire.protocol import EngineAddresses, Init
from raydp.wire.transport import IpcDir, ipc_prefix, remove_cluster_ipc_dirs, socket_options

logger = logging.getLogger("raydp.local")
LOCAL_NODE = "local"
CONTROL_TIMEOUT_S = 30.0


def _send(conn: Connection, value: Any) -> None:
    """Control messages are msgpack too: no pickle crosses this socketpair either."""
    conn.send_bytes(msgspec.msgpack.encode(value))


def _recv(conn: Connection, kind: Any) -> Any:
    return msgspec.msgpack.decode(conn.recv_bytes(), type=kind)


def _engine_main(
    config: RaydpConfig, rank: int, addresses: list[str], prefix: str, death_pipe: Connection
) -> None:
    from raydp.engine.host import EngineHost
    from raydp.local.executor import MPExecutor

    said: list[bool] = []

    def last_words(exc: BaseException) -> None:
        if not said:
            said.append(True)
            leave_last_words(death_pipe, _encode_death(exc))

    try:
        host = EngineHost(config, rank, rank, LOCAL_NODE, LOCAL_NODE, ipc_prefix=prefix, executor_factory=MPExecutor)
        host.on_failure = last_words
        set_process_title(f"raydp::{host.tag}")
        on_stop_signals(host.shutdown)
        watch_parent(death_pipe, host.shutdown)
        host.run(addresses)
    except BaseException as exc:
        last_words(exc)
        raise


class _LastWords(msgspec.Struct, frozen=True):
    """Why an engine process failed, sent to the parent before it exits."""

    cause: str
    message: str


def _encode_death(exc: BaseException) -> bytes:
    cause = exc.cause.value if isinstance(exc, ComponentDeadError) else DeathCause.ENGINE_ERROR.value
    return msgspec.msgpack.encode(_LastWords(cause, f"{type(exc).__name__}: {exc}"))


def _decode_death(words: bytes | None) -> _LastWords | None:
    try:
        return msgspec.msgpack.decode(words, type=_LastWords) if words else None
    except (msgspec.DecodeError, ValueError):
        return None


def _coordinator_main(config: RaydpConfig, prefix: str, conn: Connection, death_pipe: Connection) -> None:
    from raydp.coordinator.loop import CoordinatorLoop
    from raydp.coordinator.state import CoordinatorState
    from raydp.logs import configure_component_logging

    configure_component_logging(f"{config.name} coordinator")
    state = CoordinatorState(config.dp_size, config.stats_interval_s, config.heartbeat_interval_s)
    loop = CoordinatorLoop(state, socket_options(config), transport="ipc", node_id=LOCAL_NODE,
                           ipc_prefix=f"{prefix}-coordinator")
    on_stop_signals(loop.stop)
    watch_parent(death_pipe, loop.stop)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    _send(conn, loop.endpoints)
    _serve_coordinator_commands(loop, conn, thread)
    loop.close()


def _serve_coordinator_commands(loop: Any, conn: Connection, thread: threading.Thread) -> None:
    while thread.is_alive():
        if not conn.poll(0.1):
            continue
        try:
            command, *args = _recv(conn, list[Any])
        except EOFError:
            return
        if command == "wait_for_engines":
            _send(conn, loop.wait_for_engines(*args))
        elif command == "wait_for_rank":
            _send(conn, loop.wait_for_rank(*args))
        elif command == "state":
            _send(conn, loop.describe())
        elif command == "shutdown":
            return  # the caller's loop.close() stops the loop and waits for its teardown


def _init(config: RaydpConfig, coordinator: CoordinatorEndpoints, dp_master: str) -> Init:
    """What every engine process is told in the handshake (all of them are on this node)."""
    return Init(EngineAddresses(coordinator.collect[0], coordinator.broadcast[0]), parallel_config(config, dp_master))


@dataclass
class _Owned(OwnedResources):
    procs: list[Proc] = field(default_factory=list)
    conn: Connection | None = None

    def stop_components(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError, ValueError):
                _send(self.conn, ["shutdown"])
        shutdown(self.procs)
        if self.name:
            remove_cluster_ipc_dirs(self.name)
        if self.conn is not None:
            self.conn.close()


class ProcessManager:
    """Engines (and the coordinator) as spawned local processes; see the module docstring."""

    def __init__(self, config: RaydpConfig, *, progress: Callable[[int, int], None] | None = None) -> None:
        if config.transport == "tcp":
            raise ConfigError("transport='tcp': the mp backend runs on one node; use 'auto' or 'ipc'")
        # Every party is on this node: "auto" means IPC only, no TCP listeners.
        config = config.with_changes(transport="ipc")
        self.config = config
        self._progress = progress
        self._reports = DeathReports()
        self.ipc_prefix = ipc_prefix(config.name)
        self._owned = _Owned(name=self.ipc_prefix)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self._owned.release)
        self._mp = mp.get_context("spawn")
        self._coordinator: CoordinatorEndpoints | None = None
        self._restarts = RestartBudget(config.max_restarts, range(config.dp_size))
        self._report_lock = threading.Lock()

    @property
    def procs(self) -> tuple[Proc, ...]:
        return tuple(self._owned.procs)

    @property
    def deaths(self) -> list[ComponentDeadError]:
        return list(self._reports.deaths)

    def on_death(self, listener: DeathListener) -> None:
        self._reports.on_death(listener)

    def on_restart(self, listener: RestartListener) -> None:
        self._reports.on_restart(listener)

    def register_api_servers(self, record: dict[str, Any]) -> None:
        """``raydp status`` reads Ray clusters only: a local cluster keeps no registry."""

    def start_api_servers(
        self, endpoints: ClusterEndpoints, node_id: str, ranks: list[int], count: int, port: int, label: str,
        settings: ServerSettings | None = None,
    ) -> APIServerGroup:
        """Every rank is on this machine: local processes, on loopback."""
        from raydp.serve.processes import APIServerProcessManager

        return APIServerProcessManager(endpoints, count, port=port, node_id=node_id, ranks=ranks, settings=settings)

    def start(self) -> ClusterEndpoints:
        try:
            self._coordinator = self._start_coordinator()
            endpoints = self._start_engines(self._coordinator)
        except BaseException:
            self.close()
            raise
        watch_processes(self._owned.procs, self._owned.stop, self._report, "raydp-proc-watcher")
        return endpoints

    def _spawn(self, name: str, target: Callable[..., None], *args: Any, rank: int | None = None) -> Proc:
        proc = spawn(self._mp, name, target, *args, rank=rank)
        self._owned.procs.append(proc)
        return proc

    def _start_coordinator(self) -> Any:
        parent, child = self._mp.Pipe()
        proc = self._spawn(
            coordinator_name(self.config.name), _coordinator_main, self.config, self.ipc_prefix, child
        )
        self._owned.conn = parent
        if not parent.poll(self.config.startup_timeout_s):
            raise StartupError(f"the coordinator did not start ({describe_exit(proc.process.exitcode)})")
        return _recv(parent, CoordinatorEndpoints)

    def _start_engines(self, coordinator: CoordinatorEndpoints) -> ClusterEndpoints:
        cfg = self.config
        owned = self._owned
        owned.ctx = zmq.Context()
        owned.ipc_dir = IpcDir(f"{self.ipc_prefix}-frontend")
        init = _init(cfg, coordinator, self._dp_master())
        result = self._handshake(list(range(cfg.dp_size)), init, self._check_alive, self._progress)
        self._wait_coordinator()
        engines = [EngineEndpoint(r, LOCAL_NODE, result.ready[r].input_addresses) for r in range(cfg.dp_size)]
        self._reports.coordinator = CoordinatorClient(coordinator, LOCAL_NODE, socket_options(cfg))
        owned.closers.append(self._reports.coordinator.close)
        return ClusterEndpoints(
            cfg.name, engines, coordinator, cfg.lockstep, result.capacity, self.ipc_prefix, cfg.heartbeat_interval_s
        )

    def _handshake(
        self, ranks: list[int], init: Init, liveness: Callable[[], None],
        progress: Callable[[int, int], None] | None = None,
    ) -> HandshakeResult:
        """Spawn the engine processes of ``ranks`` and run them through the handshake."""
        cfg, owned = self.config, self._owned
        assert owned.ctx is not None
        server = HandshakeServer(owned.ctx, socket_options(cfg), transport="ipc", ipc_dir=owned.ipc_dir)
        try:
            with owned.lock:  # close() must not miss a process started behind its back (a restart's)
                if owned.released:
                    raise StartupError(f"cluster {cfg.name!r} is closing")
                for rank in ranks:
                    self._spawn(rank_name(cfg.name, rank), _engine_main, cfg, rank, server.addresses, self.ipc_prefix,
                                rank=rank)
            return server.run(dict.fromkeys(ranks, True), lambda _: init, cfg.config_hash(), cfg.startup_timeout_s,
                              liveness=liveness, progress=progress)
        finally:
            server.close()

    def _dp_master(self) -> str:
        """The parent hosts the rendezvous: it outlives every rank, and binding here leaves no race."""
        if not self.config.lockstep:
            return ""
        from raydp.engine.collective import Rendezvous

        rendezvous = Rendezvous("127.0.0.1", self.config.dp_size)
        self._owned.closers.append(rendezvous.close)
        return rendezvous.address

    def _wait_coordinator(self) -> None:
        wait_s = self.config.handshake_timeout_s
        if not self._ask("wait_for_engines", self.config.dp_size, wait_s, timeout_s=wait_s + CONTROL_TIMEOUT_S):
            raise StartupError("engines did not subscribe to the coordinator's broadcast in time")

    def _ask(self, *command: Any, timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
        conn = self._owned.conn
        if conn is None:
            raise StartupError("the coordinator process stopped answering")
        with self._lock:
            _send(conn, list(command))
            if not conn.poll(timeout_s):
                # A late answer would be read as the reply to the next question.
                conn.close()
                self._owned.conn = None
                raise StartupError(f"the coordinator process did not answer {command[0]!r}")
            return _recv(conn, Any)

    def coordinator_state(self) -> dict[str, Any]:
        return dict(self._ask("state"))

    def scale(self, dp_size: int, drain_timeout_s: float) -> ClusterEndpoints:
        raise ConfigError(f"dp_size={dp_size}: backend='mp' runs a fixed set of local processes; "
                          "scale() needs backend='ray'")

    def on_scale(self, listener: ScaleListener) -> None:
        pass  # never scales

    def _check_alive(self, procs: list[Proc] | None = None) -> None:
        for proc in self._owned.procs if procs is None else procs:
            if not proc.process.is_alive():
                words = _decode_death(last_words(proc))
                why = f":\n{words.message}" if words else ""
                raise StartupError(f"{proc.name} died during startup ({describe_exit(proc.process.exitcode)}){why}")

    def _report(self, proc: Proc) -> None:
        words = _decode_death(last_words(proc)) if proc.rank is not None else None
        if words is None:
            proc.process.join(timeout=1)
        code = proc.process.exitcode
        with self._report_lock:  # each restarted rank has a watcher thread of its own
            restarting = proc.rank is not None and self._may_restart(proc.rank)
        err: ComponentDeadError
        if proc.rank is None:
            err = ProcessDeadError(f"{proc.name} (pid {proc.process.pid})", code, LOCAL_NODE)
        elif words is not None:  # it said why (e.g. one of its workers died), and is exiting now
            err = EngineDeadError(proc.rank, LOCAL_NODE, DeathCause(words.cause),
                                  f"{proc.name} pid {proc.process.pid}: {words.message}", restarting)
        else:
            detail = f"{proc.name} pid {proc.process.pid} {describe_exit(code)}"
            err = EngineDeadError(proc.rank, LOCAL_NODE, DeathCause.of_exit(code), detail, restarting)
        self._reports.died(err)
        if self.config.lockstep:
            # A broken collective would hold the surviving ranks for minutes.
            shutdown([p for p in self._owned.procs if p.rank is not None and p is not proc], grace_s=0.5)
        elif restarting:
            threading.Thread(target=self._restart, args=(proc,), name=f"raydp-restart-{proc.rank}",
                             daemon=True).start()

    # ---- restarts (dense mode) ---------------------------------------------------------

    def _may_restart(self, rank: int) -> bool:
        return not self.config.lockstep and not self._owned.stop.is_set() and self._restarts.take(rank)

    def _restart(self, old: Proc) -> None:
        """A new process for ``old``'s rank; a failed restart ends the rank for good, reported ``INIT_FAILED``."""
        rank = old.rank
        assert rank is not None and self._coordinator is not None
        shutdown([old], grace_s=0.5)  # one that failed on its own may still be tearing down
        init = _init(self.config, self._coordinator, "")
        try:
            with self._owned.lock:
                if self._owned.released:
                    return
                self._owned.procs.remove(old)
            result = self._handshake([rank], init, lambda: self._check_restarting(rank))
            wait_s = self.config.handshake_timeout_s
            if not self._ask("wait_for_rank", rank, wait_s, timeout_s=wait_s + CONTROL_TIMEOUT_S):
                raise StartupError(f"engine rank {rank} did not subscribe to the coordinator's broadcast in time")
        except Exception as exc:
            shutdown([p for p in self._owned.procs if p.rank == rank], grace_s=0.5)  # no half-started successor
            if not self._owned.stop.is_set():
                with self._report_lock:
                    self._restarts.exhaust(rank)
                self._reports.died(EngineDeadError(rank, LOCAL_NODE, DeathCause.INIT_FAILED, f"restart failed: {exc}"))
            return
        if self._owned.stop.is_set():
            return  # closed meanwhile: release() ended the new process too
        new = next(p for p in self._owned.procs if p.rank == rank)
        watch_processes([new], self._owned.stop, self._report, f"raydp-proc-watcher-{rank}")
        self._reports.revived(EngineEndpoint(rank, LOCAL_NODE, result.ready[rank].input_addresses))

    def _check_restarting(self, rank: int) -> None:
        """A restart fails at once if close() began or its new process died (other ranks may be dead)."""
        if self._owned.stop.is_set():
            raise StartupError(f"cluster {self.config.name!r} is closing")
        self._check_alive([p for p in self._owned.procs if p.rank == rank])

    def close(self) -> None:
        self._finalizer()

