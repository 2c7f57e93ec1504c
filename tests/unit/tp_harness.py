"""An in-process Executor for tensor-parallel workers: every shard in a thread of this process.

The shards' all-reduce is :class:`ThreadGroup`'s, a barrier plus a shared sum,
so a test needs neither Ray nor ``torch.distributed``. Every control call and
step input goes through a msgpack round trip, as on the real channel, so a
non-builtin value in a step input fails here too.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch

from raydp.engine.core import EngineContext
from raydp.engine.executor import WorkerContext
from raydp.errors import DeathCause, WorkerDeadError, WorkerError
from raydp.models.tp_lm import TPLMWorker

NODE = "node-test"


class ThreadGroup:
    """A fake all-reduce over ``world_size`` threads: each posts its tensor, all sum them in rank order."""

    def __init__(self, world_size: int, timeout_s: float = 20.0) -> None:
        self.barrier = threading.Barrier(world_size, timeout=timeout_s)
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.calls = [0] * world_size

    def all_reduce_for(self, rank: int) -> Callable[[torch.Tensor], None]:
        def all_reduce(tensor: torch.Tensor) -> None:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()  # every rank has posted
            total = sum(self.slots[1:], start=self.slots[0].clone())
            self.barrier.wait()  # every rank has read: slots may be reused
            tensor.copy_(total)
            self.calls[rank] += 1

        return all_reduce


def _roundtrip(value: Any) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(value))


class ThreadExecutor:
    """``world_size`` TPLMWorker shards driven as raydp's executor drives worker processes.

    With one shard every call runs in the caller's thread (the torch profiler
    records only the thread it was started in).
    """

    def __init__(self, world_size: int, device: str = "cpu") -> None:
        self.group = ThreadGroup(world_size)
        self.workers = [
            TPLMWorker(WorkerContext(0, rank, world_size, NODE, device), all_reduce=self.group.all_reduce_for(rank))
            for rank in range(world_size)
        ]
        self._pool = ThreadPoolExecutor(world_size) if world_size > 1 else None
        self.step_inputs: list[Any] = []
        self.closed = False

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        driver_only: bool = False,
    ) -> list[Any]:
        args, kwargs = _roundtrip(list(args)), _roundtrip(dict(kwargs or {}))
        workers = self.workers[:1] if driver_only else self.workers
        return _roundtrip(self._on_all(workers, method, lambda w: getattr(w, method)(*args, **kwargs)))

    def execute_step(self, step_input: Any) -> Any:
        self.step_inputs.append(step_input)
        sent = _roundtrip(step_input)
        results = self._on_all(self.workers, "execute_step", lambda w: w.execute_step(sent))
        assert all(r == results[0] for r in results), f"shards disagree: {results}"
        return _roundtrip(results[0])

    def _on_all(self, workers: list[TPLMWorker], method: str, call: Callable[[TPLMWorker], Any]) -> list[Any]:
        if self.closed:
            raise WorkerDeadError(0, 0, NODE, DeathCause.EXITED, "executor closed")
        if self._pool is None:
            return [self._guarded(workers[0], method, call)]
        futures = [self._pool.submit(self._guarded, w, method, call) for w in workers]
        return [f.result() for f in futures]

    def _guarded(self, worker: TPLMWorker, method: str, call: Callable[[TPLMWorker], Any]) -> Any:
        try:
            return call(worker)
        except Exception as exc:
            self.group.barrier.abort()  # release the other shards instead of hanging them
            raise WorkerError(
                0, worker.context.tp_rank, NODE, method, "".join(traceback.format_exception(exc))
            ) from exc

    def check_health(self) -> None:
        if self.closed:
            raise WorkerDeadError(0, 0, NODE, DeathCause.EXITED, "executor closed")

    def close(self) -> None:
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown()


def context(executor: ThreadExecutor | None) -> EngineContext:
    return EngineContext(0, 0, 1, 1, NODE, executor=executor)
