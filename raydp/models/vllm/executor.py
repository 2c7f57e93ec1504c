"""vLLM ``Executor`` classes for a rank: over its raydp device workers, or in its own process.

:func:`executor_class` is ``RaydpVllmExecutor``, over a rank's raydp device workers.

vLLM's ``EngineCore`` drives its workers through an executor; with tensor
parallelism in a raydp rank, this is it. Control calls (``collective_rpc``:
memory profiling, KV-cache specs, warm-up, ...) go out as raydp
``collective_rpc`` calls, and each step (vLLM 0.32's ``execute_model`` and
then ``sample_tokens``) as one raydp ``execute_step`` over the rank's own
channel, never a Ray call. What crosses, and how it is encoded, is in
:mod:`raydp.models.vllm.workers`. A worker's death reaches the rank through
raydp's executor (``WorkerDeadError``), which fails the rank as for any engine.

:func:`one_process_class` is what a one-device rank runs instead of vLLM's
``UniProcExecutor``: the same, but its one-process torch rendezvous file is in
the rank's own scratch directory (``EngineContext.scratch_dir``) rather than in
the temp folder, where only a clean exit removes it; a killed rank, and every
restart is one, would leave one behind. (A TCP rendezvous would leave no file,
but torch's store listens on every interface, unauthenticated.)
"""

from __future__ import annotations

import secrets
from concurrent.futures import Future
from typing import Any

from raydp.engine.executor import Executor as RaydpExecutor
from raydp.models.vllm.workers import dumps, loads


def executor_class(workers: RaydpExecutor, init_method: str) -> type[Any]:
    """A vLLM ``Executor`` class bound to ``workers`` (vLLM constructs it from the config alone)."""
    from vllm.v1.executor.abstract import Executor

    class RaydpVllmExecutor(Executor):  # type: ignore[misc]
        """vLLM's executor interface over raydp's; see the module docstring."""

        uses_ray = False
        supports_pp = False

        def _init_executor(self) -> None:
            self._workers = workers
            workers.collective_rpc("vllm_init", [dumps((self.vllm_config, init_method))])

        def collective_rpc(
            self,
            method: Any,
            timeout: float | None = None,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
            non_block: bool = False,
        ) -> Any:
            payload = dumps((method, args, kwargs or {}))
            replies = [loads(r) for r in self._workers.collective_rpc("vllm_rpc", [payload], timeout_s=timeout)]
            return _done(replies) if non_block else replies

        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            return self._step("execute_model", scheduler_output, non_block)

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
            return self._step("sample_tokens", grammar_output, non_block)

        def execute_dummy_batch(self) -> None:
            self._step("execute_dummy_batch", None, False, with_arg=False)

        def _step(self, method: str, arg: Any, non_block: bool, with_arg: bool = True) -> Any:
            payload = dumps((method, (arg,) if with_arg else (), {}))
            result = loads(self._workers.execute_step(payload))
            return _done(result) if non_block else result

        def check_health(self) -> None:
            self._workers.check_health()

        def shutdown(self) -> None:
            pass  # raydp stops the workers when the rank ends (EngineHost._release)

    return RaydpVllmExecutor


def _done(value: Any) -> Future[Any]:
    # The step already ran when the call returned: vLLM's non-blocking callers get a settled future.
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def one_process_class(default: type[Any], scratch_dir: str | None) -> type[Any]:
    """vLLM's one-process executor with its rendezvous file in ``scratch_dir`` (see the module docstring);
    other executors (a user's choice of ``distributed_executor_backend``), or no directory, as they are."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    if default is not UniProcExecutor or scratch_dir is None:
        return default
    init_method = f"file://{scratch_dir}/vllm-dist-{secrets.token_hex(8)}"

    class ScratchUniProcExecutor(UniProcExecutor):  # type: ignore[misc]
        """``UniProcExecutor`` whose rendezvous file lives in the rank's own directory."""

        def _distributed_args(self) -> tuple[str, int, int]:
            method, rank, local_rank = super()._distributed_args()
            # vLLM's TCP rendezvous (ROCm's AITER all-reduce asserts on a file store) stays as it is.
            return (init_method if method.startswith("file://") else method), rank, local_rank

    return ScratchUniProcExecutor
