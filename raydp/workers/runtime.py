"""One device worker, in any process: join the rank's device group, build the worker, serve calls.

:class:`WorkerRuntime` knows nothing of Ray: ``actors/workers.py`` hosts it in
a Ray actor, :mod:`raydp.local.executor` in a child process of the engine.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from raydp.engine.executor import WORKER_DESCRIBE, Worker, WorkerContext
from raydp.engine.gloo_interface import use_interface_of
from raydp.errors import ConfigError, RaydpError
from raydp.wire.transport import node_ip
from raydp.workers.channel import RPC, STEP, STOP, Call, Link, LinkClosedError, Reply, call_decoder, call_encoder

logger = logging.getLogger("raydp.worker")


class WorkerRuntime:
    """A worker's lifecycle: constructed -> (group joined, worker built) -> serving -> stopped."""

    def __init__(
        self,
        context: WorkerContext,
        worker_class: str | type,
        store_address: str,
        timeout_s: float = 300.0,
        store: Any = None,
    ) -> None:
        """``store``: the group's TCPStore when this worker hosts it (else it connects to ``store_address``)."""
        self.context = context
        self._stop = threading.Event()
        self._joined = _join_group(context, store_address, timeout_s, store)
        cls = load_worker_class(worker_class)
        self.worker: Worker = cls(context)

    def call(self, method: str, args: Any = (), kwargs: Any = None) -> Any:
        """Run a public method of the worker (control path); ``raydp_describe`` is answered here."""
        if method == WORKER_DESCRIBE:
            return self.describe()
        if method.startswith("_"):
            raise AttributeError(f"{method!r} is not a public worker method")
        return getattr(self.worker, method)(*(args or ()), **(kwargs or {}))

    def describe(self) -> dict[str, Any]:
        """Where this worker runs and what it sees, for operators and tests."""
        return self.context.describe()

    def serve(self, link: Link, on_idle: Callable[[], None] | None = None) -> None:
        """Answer calls on ``link`` until STOP, the driver's end closing, or :meth:`stop`.

        ``on_idle`` runs every poll slice while no call arrives.
        """

        def idle() -> None:
            self._check_stop()
            if on_idle is not None:
                on_idle()

        try:
            while not self._stop.is_set():
                try:
                    frame = link.recv(None, idle)
                except (LinkClosedError, _StoppedError):
                    return
                call = call_decoder.decode(frame)
                if call.kind == STOP:
                    return
                reply = self._answer(call)
                if reply is not None:
                    link.send(reply)
        finally:
            link.close()

    def _answer(self, call: Call) -> bytes | None:
        try:
            if call.kind == STEP:
                value = self.worker.execute_step(call.args)
                # Only the driver's output is used: the others stay silent unless they fail.
                return call_encoder.encode(Reply(call.seq, True, value)) if self.context.tp_rank == 0 else None
            if call.kind == RPC:
                return call_encoder.encode(Reply(call.seq, True, self.call(call.method, call.args, call.kwargs)))
            return call_encoder.encode(Reply(call.seq, False, f"unknown call kind {call.kind}"))
        except Exception:
            logger.exception("worker %s: %s failed", self.context.tag, call.method or "execute_step")
            return call_encoder.encode(Reply(call.seq, False, traceback.format_exc()))

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise _StoppedError

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Leave the device group (after serving ends)."""
        shutdown = getattr(self.worker, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:
                logger.exception("worker %s: shutdown failed", self.context.tag)
        if self._joined:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


class _StoppedError(RaydpError):
    """The worker was told to stop while it waited for a call."""


def load_worker_class(worker_class: str | type) -> type:
    cls = worker_class if isinstance(worker_class, type) else _import_class(worker_class)
    if not callable(getattr(cls, "execute_step", None)):
        raise ConfigError(f"worker_class={worker_class!r}: has no execute_step method")
    return cls


def _import_class(path: str) -> type:
    """Import ``module:Class`` (as engine classes are, without their method check)."""
    import importlib

    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"worker_class={path!r}: cannot import it ({exc})") from None
    if not isinstance(obj, type):
        raise ConfigError(f"worker_class={path!r}: not a class")
    return obj


def local_device(accelerator: str) -> str:
    """The torch device of a worker that sees only its own device: ``cuda:0`` or ``cpu``."""
    if accelerator != "GPU":
        return "cpu"
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _join_group(context: WorkerContext, store_address: str, timeout_s: float, store: Any = None) -> bool:
    """Form the rank's device group at its store: nccl with CUDA, else gloo."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if context.device.startswith("cuda") and torch.cuda.is_available() else "gloo"
    if context.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(context.device))
    host, _, port = store_address.rpartition(":")
    timeout = datetime.timedelta(seconds=timeout_s)
    started = time.monotonic()
    if store is None:
        store = dist.TCPStore(host, int(port), context.world_size, is_master=False, timeout=timeout)
    use_interface_of(node_ip())  # gloo: this node's own interface, not where the hostname resolves
    dist.init_process_group(backend, store=store, rank=context.tp_rank, world_size=context.world_size, timeout=timeout)
    logger.info(
        "worker %s joined its %s group of %d in %.2fs",
        context.tag,
        backend,
        context.world_size,
        time.monotonic() - started,
    )
    return True


__all__ = ["WorkerRuntime", "load_worker_class", "local_device"]
