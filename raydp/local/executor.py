"""``MPExecutor``: a rank's device workers as child processes of its engine (the mp backend).

Each worker is a spawned process with two pipes: a *ready* pipe, on which it
reports that it joined the device group and built its worker (or sends its
traceback), and the parent-death pipe of :mod:`raydp.processes`, so that it
exits when the engine process dies, even by SIGKILL. SIGTERM and SIGINT
end a worker gracefully: it finishes the call it is in and leaves its group.
The engine's executor notices a worker's exit through its process sentinel.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from raydp.config import RaydpConfig
from raydp.engine.core import preload_modules
from raydp.engine.executor import WorkerContext, WorkerGroupSpec
from raydp.engine.host import set_device_visibility
from raydp.errors import ConfigError, DeathCause, StartupError
from raydp.fork_server import child_context, gpu_driver_present
from raydp.logs import configure_component_logging
from raydp.processes import (
    Proc,
    end_orphan,
    last_words,
    on_stop_signals,
    set_process_title,
    shutdown,
    spawn,
    watch_parent,
    watch_processes,
)
from raydp.wire.transport import SocketOptions
from raydp.workers.channel import ChannelServer, connect_worker
from raydp.workers.executor import ChannelExecutor, DeathHandler
from raydp.workers.runtime import load_worker_class

STOP_GRACE_S = 2.0


def check_device_count(accelerator: str, needed: int, what: str, have: int | None = None) -> None:
    """Where CUDA is present (``have``: its device count), there must be a device per worker.

    Without CUDA the workers run on the CPU (gloo), on logical devices.
    """
    if accelerator != "GPU":
        return
    if have is None:
        if not gpu_driver_present():  # no driver, no CUDA: known without importing torch (~2 CPU-seconds)
            return
        import torch

        if not torch.cuda.is_available():
            return
        have = torch.cuda.device_count()
    if have < needed:
        raise ConfigError(f"{what} needs {needed} CUDA devices; this machine has {have}")


def _worker_main(
    context: WorkerContext,
    spec: WorkerGroupSpec,
    store: str,
    channel: list[str],
    ready: Connection,
    death_pipe: Connection,
) -> None:
    from raydp.workers.runtime import WorkerRuntime, local_device

    label = spec.label(context.tp_rank)
    configure_component_logging(label)
    set_process_title(f"raydp::{label}")
    set_device_visibility(spec.accelerator, context.device_ids)  # before torch sees a device
    context = replace(context, device=local_device(spec.accelerator))
    try:
        runtime = WorkerRuntime(context, spec.worker_class, store, spec.timeout_s)
        link = connect_worker(channel, context.tp_rank, True, None, spec.max_message_bytes, context.world_size)
    except BaseException:
        ready.send_bytes(traceback.format_exc().encode())
        raise
    on_stop_signals(runtime.stop)
    watch_parent(death_pipe, runtime.stop)
    ready.send_bytes(b"")
    try:
        runtime.serve(link)
    finally:
        runtime.close()


class MPExecutor(ChannelExecutor):
    """``world_size`` worker processes of one rank; see the module docstring."""

    def __init__(self, spec: WorkerGroupSpec, on_death: DeathHandler | None = None) -> None:
        ws = spec.world_size
        top = int(spec.device_ids[-1]) + 1 if spec.device_ids else (spec.dp_rank + 1) * ws
        check_device_count(spec.accelerator, top, f"rank {spec.dp_rank} with world_size={ws} (devices per rank)")
        contexts = [_context(spec, tp) for tp in range(ws)]
        super().__init__(contexts, on_death)
        self.spec = spec
        self.procs: list[Proc] = []
        self._stop = threading.Event()
        self._rendezvous: Any = None
        try:
            self._start()
        except BaseException:
            self._stop_workers(graceful=False)
            raise
        watch_processes(self.procs, self._stop, self._on_exit, f"raydp-workers-dp{spec.dp_rank}")

    def _start(self) -> None:
        from raydp.engine.collective import Rendezvous

        spec = self.spec
        self._rendezvous = Rendezvous("127.0.0.1", spec.world_size)
        server = ChannelServer(
            spec.ipc_dir, SocketOptions(max_message_bytes=spec.max_message_bytes), remote=False, ctx=None
        )
        # The engine runs in a daemon process, which multiprocessing forbids to have
        # children; its workers still end with it (parent-death pipes, daemon flag).
        mp.current_process().daemon = False
        ctx = child_context(preload_modules(load_worker_class(spec.worker_class)))
        readers = []
        try:
            for context in self.contexts:
                reader, writer = ctx.Pipe(duplex=False)
                readers.append(reader)
                self.procs.append(
                    spawn(
                        ctx,
                        spec.label(context.tp_rank),
                        _worker_main,
                        context,
                        spec,
                        self._rendezvous.address,
                        server.addresses,
                        writer,
                        rank=context.tp_rank,
                    )
                )
                writer.close()
            self.links = server.accept(spec.world_size, spec.timeout_s, self._check_started)
            for tp, reader in enumerate(readers):
                self._wait_ready(tp, reader)
        finally:
            server.close()
            for reader in readers:
                reader.close()

    def _wait_ready(self, tp: int, reader: Connection) -> None:
        if not reader.poll(self.spec.timeout_s):
            raise StartupError(f"worker {self.spec.label(tp)} did not become ready in time")
        try:
            words = reader.recv_bytes()
        except EOFError:
            end_orphan(self.procs[tp])
            words = f"it exited first ({self.procs[tp].exit_text()})".encode()
        if words:
            raise StartupError(f"worker {self.spec.label(tp)} failed to start:\n{words.decode(errors='replace')}")

    def _check_started(self) -> None:
        for proc in self.procs:
            if proc.process.exitcode is not None:
                end_orphan(proc)
                raise StartupError(f"worker {proc.name} exited during startup ({proc.exit_text()})")

    def _on_exit(self, proc: Proc) -> None:
        proc.process.join(timeout=1)
        code = proc.exitcode
        words = last_words(proc)
        detail = f"pid {proc.process.pid} {proc.exit_text()}" + (f": {words.decode()}" if words else "")
        assert proc.rank is not None
        self.mark_dead(proc.rank, DeathCause.of_exit(code), detail)

    def _stop_workers(self, graceful: bool) -> None:
        self._stop.set()
        shutdown(self.procs, grace_s=STOP_GRACE_S if graceful else 0.0)
        if self._rendezvous is not None:
            self._rendezvous.close()


def rank_device_ids(config: RaydpConfig, rank: int) -> tuple[str, ...]:
    """The devices of this machine ``rank`` takes (logical ones where it has none): its own number, after
    those of the ranks before it."""
    first = config.devices_before(rank)
    return tuple(str(first + tp) for tp in range(config.world_size_of(rank)))


def _context(spec: WorkerGroupSpec, tp: int) -> WorkerContext:
    ids = spec.device_ids[tp : tp + 1] or (str(spec.dp_rank * spec.world_size + tp),)
    return WorkerContext(spec.dp_rank, tp, spec.world_size, spec.node_id, "cpu", ids)


__all__ = ["MPExecutor", "check_device_count", "rank_device_ids"]
