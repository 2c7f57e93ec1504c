"""``EchoEngine``: the built-in engine core that echoes prompts, for tests, benchmarks and the demo."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from raydp.engine.core import EngineContext
from raydp.models.reference import ReferenceEngine, Running
from raydp.wire.protocol import Output, Request


@dataclass(kw_only=True)
class _Echo(Running):
    prompt: list[int]
    offset: int = 0  # tokens of the echo made before it came here (a P/D decode: the prefill's)


class EchoEngine(ReferenceEngine[_Echo]):
    """Echoes each prompt back one token per step, ``max_tokens`` tokens in all.

    ``max_running`` bounds the running batch (the rest waits), so load numbers
    mean what they do in a real inference engine. ``step_delay_s`` makes each
    step sleep, to stand in for device time in tests and benchmarks. With
    ``collective=True`` every step and dummy batch all-reduces a tensor over
    the DP group, as an expert-parallel forward pass does: a rank missing from
    a step would hang its peers. With ``prefix_cache_blocks`` it keeps a
    prefix cache of that many blocks of ``block_size`` tokens
    (:class:`~raydp.models.prefix_cache.BlockCache`: which blocks it would
    hold, not KV state; see ``keep_prefix_cache``) and reports it through ``cache_events()``, as vLLM
    engines do, for the tests of prefix-cache-aware routing. With ``max_loras``
    it holds that many LoRA adapters (:class:`~raydp.models.adapter_slots.AdapterSlots`:
    names, no weights), each load stalling a step ``adapter_load_s`` seconds,
    and reports them through ``adapters()``, for adapter-aware routing. A P/D
    decode request (``prefilled`` set) goes on with the echo of the prompt its
    prefill saw, so P/D answers equal collocated ones.
    """

    engine_name: ClassVar[str] = "EchoEngine"

    def __init__(
        self,
        context: EngineContext,
        max_running: int = 256,
        step_delay_s: float = 0.0,
        collective: bool = False,
        prefix_cache_blocks: int = 0,
        block_size: int = 16,
        max_loras: int = 0,
        adapter_load_s: float = 0.0,
    ) -> None:
        super().__init__(max_running)
        self.keep_prefix_cache(prefix_cache_blocks, block_size)
        self.keep_adapters(max_loras, adapter_load_s)
        self.context = context
        self.step_delay_s = step_delay_s
        self.collective = collective
        self._dp_group: Any = None
        self.collectives = 0
        self.last_work_step = 0
        self.steps = 0
        self.dummy_steps = 0

    def capacity(self) -> int:
        return self.max_running

    def _start(self, request: Request) -> _Echo:
        prompt = request.prompt_token_ids or [0]
        if 0 < request.prefilled < len(prompt):  # P/D: go on with the echo of the prompt the prefill saw
            return _Echo(
                budget=request.max_tokens, prompt=prompt[: request.prefilled], offset=len(prompt) - request.prefilled
            )
        return _Echo(budget=request.max_tokens, prompt=prompt)

    def attach_dp_group(self, group: Any) -> bool:
        """Called by the engine loop in lockstep mode with the DP process group.

        Returns whether the forward pass runs collectives over it (then the
        ranks collect their wave all-reduce at agreed steps).
        """
        import torch

        self._dp_group = group
        self._ones = torch.ones(1)  # the forward pass's stand-in collective payload
        return self.collective

    def _forward(self) -> None:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.collective and self._dp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(self._ones, group=self._dp_group)
            self.collectives += 1

    def step(self) -> list[Output]:
        self._admit()
        self.steps += 1
        self.last_work_step = self.steps + self.dummy_steps
        self._forward()
        # Each running request's next prompt token, cycling through the prompt.
        tokens = [
            (rid, echo.prompt[(echo.offset + echo.produced) % len(echo.prompt)]) for rid, echo in self._running.items()
        ]
        return [self._advance(rid, token) for rid, token in tokens]

    def execute_dummy_batch(self) -> None:
        self.dummy_steps += 1
        self._forward()

    def describe(self) -> dict[str, Any]:
        """Where this rank runs and which devices it sees (called as a utility)."""
        return {
            "rank": self.context.rank,
            "node_id": self.context.node_id,
            "pid": os.getpid(),
            "device_ids": list(self.context.device_ids),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def stats(self) -> dict[str, int]:
        """Counters for tests and the demo summary (called as a utility)."""
        return {
            "steps": self.steps,
            "dummy_steps": self.dummy_steps,
            "collectives": self.collectives,
            "last_work_step": self.last_work_step,
            "dp_group_size": self._group_size(),
            "cached_blocks": len(self.prefix_cache) if self.prefix_cache is not None else 0,
            "prefix_hits": self.prefix_cache.hits if self.prefix_cache is not None else 0,
        }

    def _group_size(self) -> int:
        """How many ranks the collective runs over (0 without a DP group)."""
        if self._dp_group is None:
            return 0
        import torch.distributed as dist

        return int(dist.get_world_size(self._dp_group)) if dist.is_initialized() else 0


__all__ = ["EchoEngine"]
