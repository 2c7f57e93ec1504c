"""``RaydpCoreClient``: vLLM's ``EngineCoreClient`` over raydp's ranks.

vLLM's ``AsyncLLM`` (its front-end: input processing, detokenizing, logprobs,
stop strings, ``n`` fan-out) talks to its engine cores through one
``EngineCoreClient``; for vLLM's own data parallelism that is
``DPLBAsyncMPClient``. In a raydp API server it is this class, over the
server's :class:`~raydp.client.client.Client`:

* **Requests.** Each ``EngineCoreRequest`` goes to a rank picked by raydp's
  balancer (least-loaded, prefix-cache affinity on its prompt's token ids,
  ...), or to the rank it names in ``data_parallel_rank``. It travels as
  vLLM's own msgpack inside a raydp request (:mod:`raydp.models.vllm.native`);
  the rank hands it to its engine core as it is.
* **Outputs.** Each rank's ``EngineCoreOutput``s come back unchanged and are
  given to ``AsyncLLM`` as ``EngineCoreOutputs``, several ranks' at once when
  they arrive together.
* **Failures.** A request that has streamed nothing when its rank dies is
  sent again to a live rank. One that has streamed goes on from its last token
  on a live rank (``migration_limit`` times), its streamed tokens appended to
  its prompt, so ``AsyncLLM`` sees no gap; unless its state cannot be
  replayed (:func:`migration_blocker`): then, and for any other failure, the
  request finishes with vLLM's ``FinishReason.ERROR`` (a 500, as vLLM answers
  a request its engine failed) and the typed error
  (:class:`~raydp.errors.MigrationRefusedError`, ...) is logged.
* **Aborts** go to the rank that holds the request.
* **Utility calls** (``add_lora``, ``reset_prefix_cache``, ``sleep``,
  ``collective_rpc``, ...) go to every live rank, as vLLM's data-parallel
  client sends them to every engine; the first rank's answer is the result
  (``*_all`` and consensus calls as vLLM's).

Outputs are reported to vLLM's stat loggers as engine 0's: the per-rank view
is raydp's (``raydp status``, the ``raydp_rank_*`` metrics).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from raydp.client.aio import LoopBatch
from raydp.client.client import Client
from raydp.client.requests import Submission
from raydp.errors import ClusterClosedError, EngineDeadError, MigrationRefusedError, RaydpError, RequestError
from raydp.models.vllm.native import NativeCodec
from raydp.serve.vllm_loras import AdapterReloads, LoraIds
from raydp.serve.vllm_unloads import ClusterUnloads
from raydp.wire.protocol import Output, Request

logger = logging.getLogger("raydp.serve.vllm")
GREEDY_BELOW = 1e-5  # vLLM's own threshold: a lower temperature decodes greedily
RELOAD_POLL_S = 0.5  # how often the first API server looks for a restarted rank to reload adapters on
CALL_TIMEOUT_S = 600.0  # sleep, wake_up and collective_rpc may take minutes on a big model

try:  # vLLM is an optional dependency: this module is imported only where it is installed
    from vllm.v1.engine.core_client import EngineCoreClient as _Base
except ImportError:  # pragma: no cover
    _Base = object


def migration_blocker(request: Any) -> str | None:
    """Why this ``EngineCoreRequest`` cannot go on, on another rank, from its last token; None if it can.

    Resuming appends the streamed tokens to the prompt and shrinks
    ``max_tokens`` and ``min_tokens`` by as many (vLLM's model runner takes a
    new request's tokens from its prompt alone). That cannot rebuild state that
    lived only on the dead rank (a grammar advanced over the tokens, a seeded
    generator's position), nor keep penalties that count output tokens only.
    """
    params = request.sampling_params
    if params is None:
        return "a pooling request has no stream to resume"
    if request.prompt_token_ids is None:
        return "a prompt given as embeddings cannot be extended with the streamed tokens"
    if params.structured_outputs is not None:
        return "structured outputs: the grammar's state over the streamed tokens lived on the dead rank"
    if params.seed is not None and params.temperature >= GREEDY_BELOW:
        return "seeded sampling: the generator's position lived on the dead rank, so the rest would not be the seed's"
    if params.presence_penalty or params.frequency_penalty:
        return "presence and frequency penalties count output tokens, and the streamed ones would resume as prompt"
    return None


class _Resources:
    """What ``AsyncLLM`` reads of its client's background state: whether the engines are gone."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @property
    def engine_dead(self) -> bool:
        return self._client.closed


class RaydpCoreClient(_Base):  # type: ignore[misc,valid-type]
    """See the module docstring. Built on the API server's event loop; ``client`` is the server's own."""

    def __init__(self, client: Client, codec: NativeCodec, unloads: ClusterUnloads | None = None) -> None:
        self.client, self.codec, self._unloads = client, codec, unloads
        self.engine_ranks_managed = [0]
        self.resources = _Resources(client)
        self._loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._batch = LoopBatch(client)
        # Outputs arrive on the client's IO thread; the event loop decodes them in one pass per wake-up.
        self._inbox: collections.deque[tuple[str, Output | RaydpError]] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._woken = False
        self._blockers: dict[str, str] = {}  # request id -> why it cannot migrate (only those that cannot)
        self.lora_ids = LoraIds()
        # One server reloads a restarted rank's adapters: the first (every server would load them again).
        self._reloads = (
            self._loop.create_task(self._reload_adapters(AdapterReloads())) if client.client_index == 0 else None
        )
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        self._output_type, self._outputs_type = EngineCoreOutput, EngineCoreOutputs
        self._error, self._length = FinishReason.ERROR, FinishReason.LENGTH

    # ---- requests ------------------------------------------------------------------------

    async def add_request_async(self, request: Any) -> None:
        params = request.sampling_params
        prompt = list(request.prompt_token_ids or [])
        max_tokens = max(1, int(params.max_tokens or 1)) if params is not None else 1
        blocker = migration_blocker(request)
        pinned = request.data_parallel_rank
        if blocker is not None:
            self._blockers[request.request_id] = blocker
        lora = request.lora_request
        adapter = str(lora.lora_name) if lora is not None else ""  # routing prefers the ranks that hold it
        request.lora_request = self.lora_ids.outgoing(lora)  # numbered as every API server numbers it
        native = Request(request.request_id, prompt, max_tokens, native=self.codec.encode(request), adapter=adapter)
        native.arrival_time = float(request.arrival_time)
        moves = 0 if blocker is not None or pinned is not None else self.client.migration_limit
        listener = self._listener(request.request_id)
        # What cannot resume on another rank cannot be split over the P/D pools either: it runs on one rank.
        self._batch.add(Submission(native, pinned, listener, True, migrations=moves, whole=blocker is not None))

    def _listener(self, request_id: str) -> Callable[[Output | RaydpError], None]:
        def listen(item: Output | RaydpError) -> None:
            with self._inbox_lock:
                self._inbox.append((request_id, item))
                if self._woken:
                    return
                self._woken = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop closed: the server stopped, nobody waits
                pass

        return listen

    def _drain(self) -> None:
        with self._inbox_lock:
            items, self._woken = list(self._inbox), False
            self._inbox.clear()
        outputs = [out for rid, item in items if (out := self._safely(rid, item)) is not None]
        if outputs:
            self._outputs.put_nowait(self._outputs_type(engine_index=0, outputs=outputs))

    def _safely(self, request_id: str, item: Output | RaydpError) -> Any:
        """:meth:`_convert`, or the request's error finish if its output cannot be read: it must not hang."""
        try:
            return self._convert(request_id, item)
        except Exception as exc:  # a malformed native output: dropped, logged, and the request failed loudly
            logger.warning("request %s: dropped an output vLLM's decoder refused: %s", request_id, exc)
            self._blockers.pop(request_id, None)
            if isinstance(item, Output) and not item.finished:
                with contextlib.suppress(ClusterClosedError):
                    self.client.abort(request_id)  # its rank stops generating for nobody
            return self._output_type(request_id, [], finish_reason=self._error, stop_reason=f"bad output: {exc}")

    def _convert(self, request_id: str, item: Output | RaydpError) -> Any:
        """The ``EngineCoreOutput`` for what raydp delivered; None for what vLLM need not see."""
        if isinstance(item, Output):
            if item.native is not None:
                if item.finished:
                    self._blockers.pop(request_id, None)
                return self.codec.output(item.native)
            if item.error is None and item.finish_reason == "abort":  # the echo of an abort vLLM asked for
                self._blockers.pop(request_id, None)
                return None
            if item.error is None and item.finish_reason == "length":  # every token was out; its rank died after
                self._blockers.pop(request_id, None)
                return self._output_type(request_id, [], finish_reason=self._length)
            item = RequestError(request_id, item.error or f"finished without an output ({item.finish_reason})")
        why = self._blockers.pop(request_id, None)
        if isinstance(item, EngineDeadError) and why is not None:
            item = MigrationRefusedError(request_id, why, item)
        logger.warning("request %s failed: %s", request_id, item)
        return self._output_type(request_id, [], finish_reason=self._error, stop_reason=str(item))

    async def get_output_async(self) -> Any:
        return await self._outputs.get()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._blockers.pop(rid, None)
            try:
                self.client.abort(rid)
            except ClusterClosedError:
                return

    # ---- utility calls -------------------------------------------------------------------

    def _live_ranks(self) -> list[int]:
        live = self.client.live_ranks()
        if not live:
            raise ClusterClosedError("no rank of the cluster is alive to answer a utility call")
        return live

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        body = self.codec.call(method, args)
        answers = await asyncio.gather(
            *(
                asyncio.to_thread(self.client.call_utility, rank, "vllm_call", body, timeout=CALL_TIMEOUT_S)
                for rank in self._live_ranks()
            )
        )
        return [self.codec.decode_result(answer) for answer in answers]

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return (await self.call_utility_all_async(method, *args))[0]

    async def call_utility_consensus_async(self, method: str, *args: Any) -> Any:
        results = await self.call_utility_all_async(method, *args)
        if any(result != results[0] for result in results):
            raise RuntimeError(f"ranks answered {method} differently: {results}")
        return results[0]

    async def get_supported_tasks_async(self) -> Any:
        return tuple(await self.call_utility_async("get_supported_tasks"))

    async def profile_async(self, is_start: bool = True, *args: Any) -> None:
        await self.call_utility_async("profile", is_start, *args)

    async def reset_mm_cache_async(self) -> None:
        await self.call_utility_async("reset_mm_cache")

    async def reset_prefix_cache_async(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return all(await self.call_utility_all_async("reset_prefix_cache", reset_running_requests, reset_connector))

    async def reset_encoder_cache_async(self) -> None:
        await self.call_utility_async("reset_encoder_cache")

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        await self.call_utility_async("sleep", level, mode)

    async def wake_up_async(self, tags: list[str] | None = None) -> bool:
        return all(await self.call_utility_all_async("wake_up", tags))

    async def is_sleeping_async(self) -> bool:
        return bool(await self.call_utility_consensus_async("is_sleeping"))

    async def release_kv_cache_memory_async(self) -> None:
        await self.call_utility_async("release_kv_cache_memory")

    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self.call_utility_async("pause_scheduler", mode, clear_cache)

    async def resume_scheduler_async(self) -> None:
        await self.call_utility_async("resume_scheduler")

    async def is_scheduler_paused_async(self) -> bool:
        return bool(await self.call_utility_consensus_async("is_scheduler_paused"))

    async def execute_dummy_batch_async(self) -> None:
        await self.call_utility_async("execute_dummy_batch")

    async def set_weight_version_async(self, weight_version: str) -> None:
        await self.call_utility_async("set_weight_version", weight_version)

    async def get_weight_version_async(self) -> str:
        return str(await self.call_utility_consensus_async("get_weight_version"))

    # Adapters cross to the ranks numbered as every API server numbers them (see raydp.serve.vllm_loras).
    async def add_lora_async(self, lora_request: Any) -> bool:
        if self._unloads is not None and lora_request is not None:
            self._unloads.added(str(lora_request.lora_name))
        return bool(await self.call_utility_async("add_lora", self.lora_ids.outgoing(lora_request)))

    async def remove_lora_async(self, lora_id: int) -> bool:
        return bool(await self.call_utility_async("remove_lora", self.lora_ids.cluster_id(lora_id)))

    async def list_loras_async(self) -> set[int]:
        return self.lora_ids.local_ids(set(await self.call_utility_async("list_loras")))

    async def pin_lora_async(self, lora_id: int) -> bool:
        return bool(await self.call_utility_async("pin_lora", self.lora_ids.cluster_id(lora_id)))

    async def save_sharded_state_async(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        await self.call_utility_async("save_sharded_state", path, pattern, max_size)

    async def collective_rpc_async(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return list(await self.call_utility_async("collective_rpc", method, timeout, args, kwargs))

    async def compute_weight_checksums_async(self) -> list[dict[str, str]]:
        per_rank = await self.call_utility_all_async("compute_weight_checksums")
        return [worker for workers in per_rank for worker in workers]

    # ---- what AsyncLLM asks of its client's state ----------------------------------------

    def dp_engines_running(self) -> bool:
        snap = self.client.snapshot()
        return bool(snap is not None and any(running for _, running in snap.counts))

    def get_kv_event_sources(self) -> dict[int, Any]:
        return {}

    async def _reload_adapters(self, reloads: AdapterReloads) -> None:
        while True:
            await asyncio.sleep(RELOAD_POLL_S)
            snap = self.client.snapshot()
            for rank, requests in reloads.due(snap) if snap is not None else []:
                for lora in requests:
                    await self._load_on(rank, lora)
                logger.info("rank %d is back: loaded again %s", rank, [lora.lora_name for lora in requests])

    async def _load_on(self, rank: int, lora: Any) -> None:
        body = self.codec.call("add_lora", (lora,))
        try:
            await asyncio.to_thread(self.client.call_utility, rank, "vllm_call", body, timeout=CALL_TIMEOUT_S)
        except RaydpError as exc:  # the rank died again, or the adapter is gone: its requests will load it
            logger.warning("rank %d: could not load adapter %r again: %s", rank, lora.lora_name, exc)

    def shutdown(self, timeout: float | None = None) -> None:
        """Requests still in flight fail with ClusterClosedError (a 500 each); the ranks run on."""
        if self._reloads is not None:
            self._reloads.cancel()
        self.client.close()
