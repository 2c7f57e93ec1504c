"""What an engine core sees of its rank's device workers, and what a worker implements.

An engine core whose class names a ``worker_class`` (``"module:Class"``) gets
one worker per device bundle of its rank: a Ray actor on the Ray backend, a
child process on the ``mp`` backend. The workers of a rank form a
``torch.distributed`` group (gloo on CPU, nccl where CUDA is present), so a
worker class can shard a model over them (tensor parallelism). The engine
core reaches them through :attr:`EngineContext.executor
<raydp.engine.core.EngineContext>`, an :class:`Executor`:

* ``collective_rpc`` for control (load weights, health, stats), on every
  worker or only the driver worker (TP rank 0);
* ``execute_step`` once per step: the input goes to every worker over raydp's
  own channel (a Unix socket on the same node, CURVE TCP across nodes; never a
  Ray call) and the driver worker's output comes back.

A worker's exception comes back as :class:`~raydp.errors.WorkerError` naming
the worker and carrying its traceback text; a worker's death as
:class:`~raydp.errors.WorkerDeadError`, and it fails the whole rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from raydp.errors import WorkerDeadError
from raydp.wire.security import CurveKeys
from raydp.wire.transport import IpcDir

WORKER_CLASS_ATTR = "worker_class"
WORKER_DESCRIBE = "raydp_describe"  # answered by raydp for any worker: where it runs, what it sees


@dataclass(frozen=True)
class WorkerContext:
    """What a worker learns about its place at construction.

    ``tp_rank`` is the worker's rank in its DP rank's device group (0 is the
    driver worker, whose step output is returned); ``device`` is the torch
    device to use (``"cuda:0"`` where CUDA is present, else ``"cpu"``).
    By the time the worker class is constructed, ``torch.distributed`` is
    initialised in its process with the ``world_size`` workers of this DP rank
    as the default group.
    """

    dp_rank: int
    tp_rank: int
    world_size: int
    node_id: str
    device: str = "cpu"
    device_ids: tuple[str, ...] = ()

    @property
    def tag(self) -> str:
        return f"dp{self.dp_rank} tp{self.tp_rank} node {self.node_id[:8]}"

    def describe(self) -> dict[str, Any]:
        """Where the worker runs and which devices its process sees, for operators and tests."""
        return {
            "dp_rank": self.dp_rank,
            "tp_rank": self.tp_rank,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "device": self.device,
            "device_ids": list(self.device_ids),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }


@runtime_checkable
class Worker(Protocol):
    """What raydp needs from a worker class: constructed as ``cls(context)``.

    ``execute_step(step_input)`` runs one step on this worker's shard. Any
    other public method can be called through ``Executor.collective_rpc``
    (the engine core passes its settings that way, e.g. ``load_model``).
    Inputs and outputs travel as msgpack: builtin types and bytes, no pickle.
    """

    def execute_step(self, step_input: Any) -> Any: ...


@runtime_checkable
class Executor(Protocol):
    """One DP rank's workers, as its engine core drives them."""

    @property
    def world_size(self) -> int: ...

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        driver_only: bool = False,
    ) -> list[Any]:
        """Run ``method`` on every worker (or only the driver) and return the results by TP rank.

        Raises :class:`~raydp.errors.WorkerError` if any worker raised,
        :class:`~raydp.errors.WorkerDeadError` if one is dead, and
        ``TimeoutError`` past ``timeout_s``.
        """
        ...

    def execute_step(self, step_input: Any) -> Any:
        """Send ``step_input`` to every worker, run one step, return the driver worker's output."""
        ...

    def check_health(self) -> None:
        """Raise :class:`~raydp.errors.WorkerDeadError` if a worker has died."""
        ...

    def close(self) -> None:
        """Stop every worker and release the channel; idempotent."""
        ...


@dataclass(frozen=True)
class WorkerGroupSpec:
    """What a backend needs to start one rank's workers (built by the engine host)."""

    cluster: str
    dp_rank: int
    world_size: int
    worker_class: str | type
    node_id: str
    accelerator: str
    device_ids: tuple[str, ...]
    ipc_dir: IpcDir
    curve: CurveKeys | None
    max_message_bytes: int
    timeout_s: float

    def label(self, tp_rank: int, node_id: str | None = None) -> str:
        """How logs and process titles name one worker."""
        return f"{self.cluster} dp{self.dp_rank} tp{tp_rank} node {(node_id or self.node_id)[:8]}"


# Builds and starts a rank's workers; the callback is told (once) if one dies.
ExecutorFactory = Callable[[WorkerGroupSpec, Callable[[WorkerDeadError], None]], Executor]
