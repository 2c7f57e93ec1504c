"""``InstantVllmEngine``: a reference engine that speaks vLLM's own requests and answers each at once.

Served by vLLM's front-end (``ServerSettings(vllm_args=("--model", DIR, ...))``,
DIR any checkpoint, for its tokenizer and config), it measures that front-end
and raydp's path beneath it with no engine cost: each request gets its
``max_tokens`` tokens (token 7, repeated) in one output with ``length``, the
step after it arrived. No torch, no model. Utility calls answer
``get_supported_tasks`` with ``("generate",)`` and anything else with None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raydp.engine.core import EngineContext
from raydp.models.vllm.native import NativeCodec
from raydp.wire.protocol import Output, Request

TOKEN = 7


class InstantVllmEngine:
    """The engine core protocol over no engine; see the module docstring."""

    def __init__(self, context: EngineContext, **_: Any) -> None:
        self.context = context
        self._codec = NativeCodec()
        from vllm.v1.engine import EngineCoreOutput, FinishReason

        self._output, self._length = EngineCoreOutput, FinishReason.LENGTH
        self._waiting: list[tuple[str, int]] = []

    def add_request(self, request: Request) -> None:
        if request.native is None:
            raise ValueError("InstantVllmEngine answers vLLM's own requests only (serve it with vLLM's front-end)")
        core = self._codec.request(request.native)
        self._waiting.append((request.request_id, int(core.sampling_params.max_tokens or 1)))

    def abort(self, request_ids: Sequence[str]) -> None:
        gone = set(request_ids)
        self._waiting = [(rid, n) for rid, n in self._waiting if rid not in gone]

    def step(self) -> list[Output]:
        done, self._waiting = self._waiting, []
        return [self._answer(rid, n) for rid, n in done]

    def _answer(self, request_id: str, count: int) -> Output:
        tokens = [TOKEN] * count
        body = self._codec.encode(self._output(request_id, tokens, finish_reason=self._length))
        return Output(request_id, tokens, True, "length", native=body)

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def load(self) -> tuple[int, int]:
        return len(self._waiting), 0

    def execute_dummy_batch(self) -> None:
        pass

    def shutdown(self) -> None:
        self._waiting.clear()

    def vllm_call(self, body: bytes) -> bytes:
        method, _ = self._codec.decode_call(body)
        return self._codec.result(("generate",) if method == "get_supported_tasks" else None)
