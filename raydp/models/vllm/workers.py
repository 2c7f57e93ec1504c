"""vLLM's workers inside raydp's device workers (tensor parallelism), and what crosses to them.

With ``tensor_parallel_size > 1`` a rank's engine core drives ``world_size``
raydp device workers (one per device bundle, each given its device by Ray,
their deaths watched by raydp). Each of them hosts one vLLM worker
(``WorkerWrapperBase``: vLLM's ``CPUWorker`` or ``Worker`` for CUDA), built by
:meth:`VllmWorker.vllm_init`. The engine core's side is
:class:`~raydp.models.vllm.executor.RaydpVllmExecutor`.

What crosses raydp's channel to them (the rank's private channel: Unix
sockets in its 0700 IPC directory, or CURVE TCP to its own workers; never a
socket that a peer outside the rank can reach):

* control (``collective_rpc``, RPC frames): ``vllm_init(payload)`` once, then
  ``vllm_rpc(payload)`` for each of vLLM's executor calls (profile memory, KV
  cache specs and layout, warm-up, ...);
* per step (``execute_step``, STEP frames): ``execute_model`` with the step's
  ``SchedulerOutput``, then ``sample_tokens``.

Each payload is one ``bytes`` field in raydp's msgpack frame, holding
``(method, args, kwargs)`` as vLLM's own executors send them: cloudpickle, as
vLLM's shared-memory queue does for the same objects. Replies are pickled
the same way. Only the rank's own workers ever decode them.

The torch.distributed group raydp formed for the rank's workers before
constructing them is the group vLLM's workers join (vLLM skips its own
``init_process_group`` when one is initialised); vLLM then builds its TP
groups inside it.

vLLM's CPU TP groups talk through named POSIX shared memory (the
``...-cpushm_<rank>`` segments and the broadcast queue's ring buffer). A
worker killed with SIGKILL never removes those names: they would outlive the
rank, and a later engine whose name collided could not start. Once every
worker of the group has mapped them, each worker removes the names it
created; the memory lives on in the mappings and goes with the last process,
however it dies.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

from raydp.engine.executor import WorkerContext
from raydp.models.vllm.config import FORK_SERVER_PRELOAD, set_process_environment

logger = logging.getLogger("raydp.models.vllm.workers")


def dumps(obj: Any) -> bytes:
    import cloudpickle

    data: bytes = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return data


def loads(data: bytes) -> Any:
    return pickle.loads(data)  # the rank's private channel only (module docstring)


class VllmWorker:
    """One TP rank of a vLLM engine, in a raydp device worker; see the module docstring.

    States: constructed (no model) -> initialised (``vllm_init``: device,
    distributed groups, weights) -> serving steps. A failing call raises in the
    worker; raydp returns it to the engine core as a ``WorkerError``.
    """

    preload_modules = FORK_SERVER_PRELOAD  # see VllmEngine

    def __init__(self, context: WorkerContext) -> None:
        set_process_environment()
        self.context = context
        self._wrapper: Any = None

    def vllm_init(self, payload: bytes) -> None:
        vllm_config, init_method = loads(payload)
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        wrapper = WorkerWrapperBase(rpc_rank=self.context.tp_rank)
        wrapper.init_worker(
            all_kwargs=[
                {
                    "vllm_config": vllm_config,
                    "local_rank": 0,  # Ray gave this process its one device: it is device 0 here
                    "rank": self.context.tp_rank,
                    "distributed_init_method": init_method,
                    "is_driver_worker": self.context.tp_rank == 0,
                }
            ]
            * (self.context.tp_rank + 1)
        )
        wrapper.init_device()
        release_shared_memory_names(self.context.tp_rank)
        wrapper.load_model()
        self._wrapper = wrapper
        logger.info("vLLM worker %s: model loaded", self.context.tag)

    def vllm_rpc(self, payload: bytes) -> bytes:
        return dumps(self._run(payload))

    def execute_step(self, step_input: bytes) -> bytes | None:
        result = self._run(step_input)
        # Only the driver's answer travels back (raydp drops the others); keep theirs off the wire.
        return dumps(result) if self.context.tp_rank == 0 else None

    def shutdown(self) -> None:
        """Called by raydp as the worker stops: vLLM's worker, then its TP groups (their shared memory)."""
        if self._wrapper is None:
            return
        wrapper, self._wrapper = self._wrapper, None
        from vllm.distributed.parallel_state import destroy_model_parallel

        try:
            wrapper.shutdown()
        finally:
            destroy_model_parallel()

    def _run(self, payload: bytes) -> Any:
        if self._wrapper is None:
            raise RuntimeError(f"vLLM worker {self.context.tag}: vllm_init has not run")
        from vllm.v1.outputs import AsyncModelRunnerOutput
        from vllm.v1.serial_utils import run_method

        method, args, kwargs = loads(payload)
        result = run_method(self._wrapper, method, args, kwargs)
        if isinstance(result, AsyncModelRunnerOutput):
            result = result.get_output()
        return result


_GROUP_GETTERS = (
    "get_world_group",
    "get_inner_dp_world_group",
    "get_tp_group",
    "get_etp_group",
    "get_dcp_group",
    "get_pp_group",
    "get_dp_group",
    "get_ep_group",
    "get_eplb_group",
    "get_pcp_group",
)


def _live_groups(parallel_state: Any) -> list[Any]:
    """vLLM's process groups this worker is in, through its public getters (an uninitialised one asserts)."""
    groups: list[Any] = []
    for getter in _GROUP_GETTERS:
        try:
            group = getattr(parallel_state, getter)()
        except (AssertionError, AttributeError):
            continue
        if group is not None and all(group is not seen for seen in groups):
            groups.append(group)
    return groups


def release_shared_memory_names(tp_rank: int) -> list[str]:
    """Unlink the shared-memory names this worker created for vLLM's groups; returns them.

    Runs after ``init_device``, whose group setup ends once every member has
    mapped the segments (a barrier) and the broadcast readers have attached.
    """
    from vllm.distributed import parallel_state

    released: list[str] = []
    for group in _live_groups(parallel_state):
        released += _release_segment(group) + _release_queue(group.mq_broadcaster)
    if released:
        logger.debug("vLLM worker tp%d released shared memory names %s", tp_rank, released)
    return released


def _release_segment(group: Any) -> list[str]:
    """This member's ``...-cpushm_<rank>`` segment of the group's CPU communicator, if it has one."""
    name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
    path = Path("/dev/shm") / f"{name}_{group.rank_in_group}"
    if not isinstance(name, str) or not path.exists():
        return []
    path.unlink()
    return [path.name]


def _release_queue(queue: Any) -> list[str]:
    """The broadcast queue's ring buffer (and tensor arena), on the writer that created them."""
    released = []
    for part in (getattr(queue, "buffer", None), getattr(queue, "tensor_arena", None)):
        if part is not None and getattr(part, "is_creator", False):
            part.shared_memory.unlink()  # also drops it from multiprocessing's resource tracker
            part.is_creator = False  # or vLLM's __del__ would unlink it a second time
            released.append(part.shared_memory.name)
    return released
