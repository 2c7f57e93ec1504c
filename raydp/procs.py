"""The multiprocessing backend: engines and the coordinator as local processes.

For runs without a Ray cluster. :class:`CoreEngineProcManager` offers the same
surface as the Ray ``ActorManager`` (``start``, ``on_death``, ``close``,
``coordinator_state``), so :class:`~raydp.cluster.Cluster` works unchanged:
the same handshake, the same sockets, liveness from process sentinels.

Child processes are spawned (no forked Ray or ZMQ state). Each holds the read
end of a parent-death pipe: when the parent dies the pipe closes and the child
shuts down. SIGTERM and SIGINT stop a child's loop cleanly; :func:`shutdown`
terminates, waits out a grace period, then kills the whole process tree.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import multiprocessing as mp
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, cast

import msgspec
import zmq

from raydp.config import RaydpConfig
from raydp.coordinator_client import CoordinatorClient
from raydp.death_listeners import DeathListener, notify
from raydp.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.errors import (
    ComponentDeadError,
    ConfigError,
    DeathCause,
    EngineDeadError,
    ProcessDeadError,
    StartupError,
    describe_exit,
)
from raydp.handshake import HandshakeServer, parallel_config
from raydp.names import coordinator_name, rank_name
from raydp.protocol import EngineAddresses, Init
from raydp.transport import IpcDir, ipc_prefix, remove_cluster_ipc_dirs, socket_options

logger = logging.getLogger("raydp.procs")
LOCAL_NODE = "local"
GRACE_S = 5.0
WATCH_TIMEOUT_S = 0.05
CONTROL_TIMEOUT_S = 30.0


def _send(conn: Connection, value: Any) -> None:
    """Control messages are msgpack too: no pickle crosses this socketpair either."""
    conn.send_bytes(msgspec.msgpack.encode(value))


def _recv(conn: Connection, kind: Any) -> Any:
    return msgspec.msgpack.decode(conn.recv_bytes(), type=kind)


@dataclass
class Proc:
    """A child process and what to call it in errors."""

    name: str
    process: BaseProcess
    rank: int | None = None
    death_pipe: Connection | None = None


def spawn(mp_ctx: Any, name: str, target: Callable[..., None], *args: Any, rank: int | None = None) -> Proc:
    """Start ``target(*args, death_pipe)`` as a daemon process; the parent keeps the pipe's writer.

    The child watches the reader: it ends when the parent goes, however the parent died.
    """
    reader, writer = mp_ctx.Pipe(duplex=False)
    process = mp_ctx.Process(target=target, args=(*args, reader), name=name, daemon=True)
    process.start()
    reader.close()
    return Proc(name, process, rank, writer)


def shutdown(procs: Sequence[Proc], grace_s: float = GRACE_S) -> None:
    """Terminate, wait up to ``grace_s``, then kill every survivor and its children."""
    alive = [p for p in procs if p.process.is_alive()]
    for p in alive:
        p.process.terminate()
    deadline = time.monotonic() + grace_s
    pending = [p.process.sentinel for p in alive]
    while pending and time.monotonic() < deadline:  # wait() returns at the first exit
        ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        pending = [s for s in pending if s not in ready]
    for p in alive:
        if p.process.is_alive():
            _kill_tree(p.process.pid)
        p.process.join(timeout=grace_s)
    for p in procs:
        if p.death_pipe is not None:
            p.death_pipe.close()


def _kill_tree(pid: int | None) -> None:
    if pid is None:
        return
    import psutil

    try:
        root = psutil.Process(pid)
        victims = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def watch_processes(
    procs: Sequence[Proc], stop: threading.Event, on_exit: Callable[[Proc], None], name: str
) -> threading.Thread:
    """Call ``on_exit(proc)`` as each process exits, until ``stop`` is set.

    A bound ``on_exit`` is held weakly, so the watcher never keeps its manager
    alive: dropping the manager still runs its finalizer.
    """
    ref: Callable[[], Callable[[Proc], None] | None] = (
        weakref.WeakMethod(on_exit) if inspect.ismethod(on_exit) else (lambda: on_exit)
    )

    def run() -> None:
        alive = {p.process.sentinel: p for p in procs}
        while alive and not stop.is_set():
            for sentinel in wait(list(alive), timeout=WATCH_TIMEOUT_S):
                proc = alive.pop(cast(int, sentinel))
                callback = ref()
                if stop.is_set() or callback is None:
                    return
                try:
                    callback(proc)
                except Exception:
                    logger.exception("reporting the exit of %s failed", proc.name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def watch_parent(death_pipe: Connection, on_parent_death: Callable[[], None]) -> None:
    """In a child: call ``on_parent_death`` once the parent's end of the pipe closes."""

    def watcher() -> None:
        with contextlib.suppress(EOFError, OSError):
            death_pipe.recv()
        on_parent_death()

    threading.Thread(target=watcher, name="raydp-parent-watch", daemon=True).start()


def on_stop_signals(stop: Callable[[], None]) -> None:
    def handler(signum: int, frame: Any) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _engine_main(
    config: RaydpConfig, rank: int, addresses: list[str], prefix: str, death_pipe: Connection
) -> None:
    from raydp.engine_host import EngineHost

    host = EngineHost(config, rank, rank, LOCAL_NODE, LOCAL_NODE, ipc_prefix=prefix)
    on_stop_signals(host.shutdown)
    watch_parent(death_pipe, host.shutdown)
    host.run(addresses)


def _coordinator_main(config: RaydpConfig, prefix: str, conn: Connection, death_pipe: Connection) -> None:
    from raydp.coordinator_loop import CoordinatorLoop
    from raydp.coordinator_state import CoordinatorState
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
        elif command == "state":
            _send(conn, loop.describe())
        elif command == "shutdown":
            loop.stop()
            thread.join(timeout=2)
            return


@dataclass
class _Owned:
    procs: list[Proc] = field(default_factory=list)
    conn: Connection | None = None
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None
    ipc_dir: IpcDir | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    released: bool = False
    name: str = ""
    closers: list[Callable[[], None]] = field(default_factory=list)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.stop.set()
        if self.conn is not None:
            with contextlib.suppress(OSError, ValueError):
                _send(self.conn, ["shutdown"])
        shutdown(self.procs)
        for close in self.closers:
            close()
        if self.name:
            remove_cluster_ipc_dirs(self.name)
        if self.conn is not None:
            self.conn.close()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        if self.ipc_dir is not None:
            self.ipc_dir.remove()


class CoreEngineProcManager:
    """Engines (and the coordinator) as spawned local processes; see the module docstring."""

    def __init__(self, config: RaydpConfig, *, progress: Callable[[int, int], None] | None = None) -> None:
        if config.transport == "tcp":
            raise ConfigError("transport='tcp': the mp backend runs on one node; use 'auto' or 'ipc'")
        # Every party is on this node: "auto" means IPC only, no TCP listeners.
        config = config.with_changes(transport="ipc")
        self.config = config
        self._progress = progress
        self._listeners: list[DeathListener] = []
        self.ipc_prefix = ipc_prefix(config.name)
        self._owned = _Owned(name=self.ipc_prefix)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self._owned.release)
        self._mp = mp.get_context("spawn")
        self.deaths: list[ComponentDeadError] = []
        self._coordinator_client: CoordinatorClient | None = None

    @property
    def procs(self) -> tuple[Proc, ...]:
        return tuple(self._owned.procs)

    def on_death(self, listener: DeathListener) -> None:
        self._listeners.append(listener)

    def on_restart(self, listener: Callable[[EngineEndpoint], None]) -> None:
        """Local processes are not restarted: a dead rank stays dead."""

    def start(self) -> ClusterEndpoints:
        try:
            coordinator = self._start_coordinator()
            endpoints = self._start_engines(coordinator)
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

    def _start_engines(self, coordinator: Any) -> ClusterEndpoints:
        cfg = self.config
        owned = self._owned
        owned.ctx = zmq.Context()
        owned.ipc_dir = IpcDir(f"{self.ipc_prefix}-frontend")
        server = HandshakeServer(owned.ctx, socket_options(cfg), transport="ipc", ipc_dir=owned.ipc_dir)
        try:
            for rank in range(cfg.dp_size):
                self._spawn(
                    rank_name(cfg.name, rank), _engine_main, cfg, rank, server.addresses, self.ipc_prefix, rank=rank
                )
            init = Init(
                EngineAddresses(coordinator.collect[0], coordinator.broadcast[0]),
                parallel_config(cfg, self._dp_master()),
            )
            result = server.run({r: True for r in range(cfg.dp_size)}, lambda _: init, cfg.config_hash(),
                                cfg.startup_timeout_s, liveness=self._check_alive, progress=self._progress)
        finally:
            server.close()
        self._wait_coordinator()
        engines = [EngineEndpoint(r, LOCAL_NODE, result.ready[r].input_addresses) for r in range(cfg.dp_size)]
        self._coordinator_client = CoordinatorClient(coordinator, LOCAL_NODE, socket_options(cfg))
        owned.closers.append(self._coordinator_client.close)
        return ClusterEndpoints(
            cfg.name, engines, coordinator, cfg.lockstep, result.capacity, self.ipc_prefix, cfg.heartbeat_interval_s
        )

    def _dp_master(self) -> str:
        """The parent hosts the rendezvous: it outlives every rank, and binding here leaves no race."""
        if not self.config.lockstep:
            return ""
        from raydp.collective import Rendezvous

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

    def _check_alive(self) -> None:
        for proc in self._owned.procs:
            if not proc.process.is_alive():
                raise StartupError(f"{proc.name} died during startup ({describe_exit(proc.process.exitcode)})")

    def _report(self, proc: Proc) -> None:
        proc.process.join(timeout=1)
        code = proc.process.exitcode
        err: ComponentDeadError
        if proc.rank is not None:
            detail = f"{proc.name} pid {proc.process.pid} {describe_exit(code)}"
            err = EngineDeadError(proc.rank, LOCAL_NODE, DeathCause.of_exit(code), detail)
        else:
            err = ProcessDeadError(f"{proc.name} (pid {proc.process.pid})", code, LOCAL_NODE)
        self.deaths.append(err)
        if proc.rank is not None and self._coordinator_client is not None:
            self._coordinator_client.engine_dead(proc.rank, err.cause.value)
        notify(self._listeners, err)
        if self.config.lockstep:
            # A broken collective would hold the surviving ranks for minutes.
            shutdown([p for p in self._owned.procs if p.rank is not None and p is not proc], grace_s=0.5)

    def close(self) -> None:
        self._finalizer()

