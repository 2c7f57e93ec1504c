"""``APIServerProcessManager``: N API server processes sharing one listening socket."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

from raydp.backend import DeathListener, notify
from raydp.errors import ConfigError, ProcessDeadError, StartupError
from raydp.fork_server import child_context
from raydp.models.vllm.config import FORK_SERVER_PRELOAD
from raydp.processes import (
    Proc,
    end_orphan,
    last_words,
    on_stop_signals,
    shutdown,
    spawn,
    watch_parent,
    watch_processes,
)
from raydp.serve.draining import stop_bound_s
from raydp.serve.metrics_dir import MetricsDir, use_metrics_dir
from raydp.serve.settings import ServerSettings
from raydp.wire.endpoints import ClusterEndpoints

logger = logging.getLogger("raydp.api")
SERVING = b"serving"  # what a server process says on its pipe once it serves


def _api_main(
    sock: socket.socket,
    endpoints: ClusterEndpoints,
    index: int,
    count: int,
    node_id: str | None,
    ranks: list[int] | None,
    settings: ServerSettings,
    metrics_dir: str | None,
    serving: Connection,
    death_pipe: Connection,
) -> None:
    if metrics_dir is not None:
        use_metrics_dir(metrics_dir)
    from raydp.logs import configure_component_logging

    configure_component_logging(f"{endpoints.name} api{index}/{count}")
    # Every stop (SIGTERM, SIGINT, the parent gone, however many) is one
    # bounded drain (:mod:`.draining`); uvicorn takes the signals over while it serves.
    stop = threading.Event()
    on_stop_signals(stop.set)
    watch_parent(death_pipe, stop.set)
    announce = _announce_serving(serving)
    if settings.vllm_args:  # vLLM's own front-end (raydp serve --engine vllm)
        from raydp.serve.vllm_server import serve_vllm_forever

        serve_vllm_forever(
            sock, endpoints, index, count, node_id, ranks=ranks, settings=settings, stop=stop, on_serving=announce
        )
        return
    from raydp.serve.server import serve_forever

    serve_forever(
        sock, endpoints, index, count, node_id, ranks=ranks, settings=settings, stop=stop, on_serving=announce
    )


def _announce_serving(serving: Connection) -> Callable[[], None]:
    """Tell the manager this server serves: one message on a pipe (no named semaphore that a SIGKILL to
    the whole tree would leave in /dev/shm)."""

    def announce() -> None:
        with contextlib.suppress(OSError, ValueError):  # nobody waits any more (a successor, or a close)
            serving.send_bytes(SERVING)
            serving.close()

    return announce


class APIServerProcessManager:
    """Binds ``host:port`` once and spawns ``count`` servers that all accept on it.

    The constructor returns once every server is serving (its app built, its
    first accept next), so a caller's first request is answered, not queued
    behind a minute of vLLM imports. A server that exits first, or is not
    serving within ``settings.startup_timeout_s``, fails the start with a
    :class:`~raydp.errors.StartupError` naming it, and the others are stopped.
    ``ranks`` restricts where their clients route (hybrid and external modes);
    a request may still pin any rank. ``settings`` (timeouts, limits, the model
    id) apply to every server.
    """

    def __init__(
        self,
        endpoints: ClusterEndpoints,
        count: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        node_id: str | None = None,
        ranks: Sequence[int] | None = None,
        settings: ServerSettings | None = None,
    ) -> None:
        if count < 1:
            raise ConfigError(f"api_servers={count}: must be >= 1")
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=1024)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._settings = settings or ServerSettings()
        self._args = (endpoints, count, list(ranks) if ranks is not None else None, self._settings)
        self._node_id = node_id  # where they serve: their clients route by it, and a death names it
        self.procs: list[Proc] = []
        self._listeners: list[DeathListener] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a respawn and close() never interleave
        self._restarts_left = [self._settings.max_restarts] * count
        # vLLM's front-ends fork from a server that has imported vLLM, where the machine allows.
        self._mp = child_context(FORK_SERVER_PRELOAD if self._settings.vllm_args else ())
        # vLLM's front-end serves /metrics for all N processes at once in prometheus_client's multiprocess
        # mode, over one directory of the processes' files (vLLM's own launcher does the same).
        self._metrics_dir = MetricsDir(endpoints.name) if self._settings.vllm_args and count > 1 else None
        self._serving: list[Connection] = []  # per server: where it says it serves
        for index in range(count):
            proc, serving = self._spawn(index)
            self.procs.append(proc)
            self._serving.append(serving)
        # A stopping server answers its running requests before it exits: wait that long before killing it.
        self._finalizer = weakref.finalize(
            self,
            _release,
            self.procs,
            self._sock,
            self._stop,
            self._lock,
            stop_bound_s(self._settings.graceful_shutdown_s),
            self._metrics_dir,
            self._serving,
        )
        try:
            _wait_serving(self.procs, self._serving, self._settings.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        watch_processes(self.procs, self._stop, self._report, "raydp-api-watcher")

    def _spawn(self, index: int) -> tuple[Proc, Connection]:
        endpoints, count, ranks, settings = self._args
        reader, writer = self._mp.Pipe(duplex=False)
        proc = spawn(
            self._mp,
            f"{endpoints.name}-api{index}",
            _api_main,
            self._sock,
            endpoints,
            index,
            count,
            self._node_id,
            ranks,
            settings,
            self._metrics_dir.path if self._metrics_dir is not None else None,
            writer,
        )
        writer.close()
        return proc, reader

    @property
    def url(self) -> str:
        return f"{self._settings.scheme}://{self.address[0]}:{self.address[1]}"

    def on_death(self, listener: DeathListener) -> None:
        self._listeners.append(listener)

    def _report(self, proc: Proc) -> None:
        """A server died: the others keep accepting on the shared socket; spawn it again while the policy allows.

        Its in-flight requests die with it (their connections close); a new
        process takes its index and its share of new connections.
        """
        proc.process.join(timeout=1)
        if self._metrics_dir is not None:
            self._metrics_dir.forget(proc.process.pid)
        with self._lock:
            index = self.procs.index(proc) if proc in self.procs else -1
            restarting = index >= 0 and not self._stop.is_set() and self._restarts_left[index] > 0
            if restarting:
                self._restarts_left[index] -= 1
        notify(
            self._listeners,
            ProcessDeadError(
                f"API server {proc.name} (pid {proc.process.pid})",
                proc.exitcode,
                self._node_id,
                restarting=restarting,
                detail=proc.exit_text(),
            ),
        )
        if not restarting:
            return
        with self._lock:
            if self._stop.is_set():  # closed meanwhile
                return
            # Not waited for: the other servers go on answering on the shared socket meanwhile.
            self._serving[index].close()
            successor, self._serving[index] = self._spawn(index)
            self.procs[index] = successor
        if proc.death_pipe is not None:
            proc.death_pipe.close()
        logger.warning("API server %s respawned as pid %s", proc.name, successor.process.pid)
        watch_processes([successor], self._stop, self._report, f"raydp-api-watcher-{index}")

    def close(self) -> None:
        self._finalizer()


def _wait_serving(procs: Sequence[Proc], serving: Sequence[Connection], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc, serving_reader in zip(procs, serving, strict=True):
        while (said := _said_serving(serving_reader)) is not True:
            if said is None:  # its end closed unsaid: it is exiting, so that the check below sees it soon
                time.sleep(0.1)
            if not proc.process.is_alive() or last_words(proc) is not None:
                end_orphan(proc)
                raise StartupError(_not_serving(proc, f"exited ({proc.exit_text()})"))
            if time.monotonic() > deadline:
                raise StartupError(_not_serving(proc, f"was not serving within startup_timeout_s={timeout_s:g}"))


def _said_serving(serving_reader: Connection) -> bool | None:
    """Whether the server said it serves, waiting up to 0.1 s for it; None once its end closed unsaid."""
    if not serving_reader.poll(0.1):
        return False
    try:
        return serving_reader.recv_bytes() == SERVING
    except (EOFError, OSError):
        return None


def _not_serving(proc: Proc, what: str) -> str:
    return f"API server {proc.name} (pid {proc.process.pid}) {what} before it served; see its log for why"


def _release(
    procs: list[Proc],
    sock: socket.socket,
    stop: threading.Event,
    lock: threading.Lock,
    grace_s: float,
    metrics_dir: MetricsDir | None,
    serving: list[Connection],
) -> None:
    with lock:  # after this no respawn starts, and ``procs`` holds every process there is
        stop.set()
    # This process's copy first: once the draining servers close theirs, the listening socket
    # is gone, so a new connection is refused at once instead of waiting in the backlog for a reset.
    sock.close()
    shutdown(procs, grace_s)
    for reader in serving:
        reader.close()
    if metrics_dir is not None:
        metrics_dir.remove()
