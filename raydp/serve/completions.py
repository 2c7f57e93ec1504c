"""The generation routes: OpenAI's ``POST /v1/completions`` and raydp's ``POST /v1/generate``.

``/v1/completions`` answers in OpenAI's ``text_completion`` shape; each
choice also carries ``token_ids`` (the generated ids) and ``rank`` (the rank
that served it), raydp extensions. With ``"stream": true`` it answers with
server-sent events, one ``data: {chunk}`` per engine output, a last chunk with
the ``finish_reason``, then ``data: [DONE]``. The first chunk is awaited
before the answer starts, so a dead rank or a timeout before any token still
gets its own status; a failure after that is sent as one ``data: {"error":
...}`` event (which OpenAI's SDKs raise), and the stream ends.

``/v1/generate`` takes ``{"prompt_token_ids", "max_tokens", "rank"?}`` and
answers ``{"token_ids": [...]}``.

Text goes through the byte tokenizer (:mod:`raydp.serve.tokenizer`). A client
that hangs up, mid-stream or while waiting, aborts its request on its engine.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from raydp.client.aio import AsyncClient
from raydp.serve import tokenizer
from raydp.serve.api_errors import ApiError
from raydp.serve.bodies import CompletionBody, GenerateBody, Limits, parse, read_body
from raydp.serve.draining import InFlight
from raydp.serve.generation import Generation, until_disconnect
from raydp.serve.metrics import ApiMetrics
from raydp.serve.responses import JSON, SSE_DONE, sse_event


@dataclass(frozen=True)
class _Shape:
    """The fields every completion object and chunk of one request share."""

    id: str
    created: int
    model: str

    def completion(
        self, text: str, token_ids: list[int], finish_reason: str | None, rank: int | None
    ) -> dict[str, Any]:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": token_ids, "rank": rank}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}


class GenerationRoutes:
    """The handlers of both routes over one :class:`AsyncClient`."""

    def __init__(
        self, aclient: AsyncClient, limits: Limits, max_body_bytes: int, timeout_s: float, metrics: ApiMetrics,
        in_flight: InFlight,
    ) -> None:
        self.aclient, self.limits, self.max_body_bytes = aclient, limits, max_body_bytes
        self.timeout_s, self.metrics, self.in_flight = timeout_s, metrics, in_flight

    def _start(self, prompt: list[int], max_tokens: int, rank: int | None) -> Generation:
        self.limits.check_max_tokens(max_tokens)
        self.limits.check_rank(rank)
        return Generation(self.aclient, prompt, max_tokens, rank, self.timeout_s, self.metrics, self.in_flight)

    async def generate(self, request: Request) -> Response:
        body = parse(GenerateBody, await read_body(request, self.max_body_bytes))
        self.limits.check_token_ids(body.prompt_token_ids, "prompt_token_ids")
        gen = self._start(body.prompt_token_ids, body.max_tokens, body.rank)
        try:
            return JSON({"token_ids": await until_disconnect(request, gen.collect())})
        finally:
            gen.close()

    async def completions(self, request: Request) -> Response:
        body = parse(CompletionBody, await read_body(request, self.max_body_bytes))
        self.limits.check_model(body.model)
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        self.limits.check_token_ids(prompt, "prompt")
        gen = self._start(prompt, body.max_tokens, body.rank)
        shape = _Shape(f"cmpl-{gen.request.request_id}", int(time.time()), self.limits.model)
        if body.stream:
            return await self._stream(request, gen, shape)
        try:
            tokens = await until_disconnect(request, gen.collect())
        finally:
            gen.close()
        answer = shape.completion(tokenizer.decode(tokens), tokens, gen.finish_reason, gen.rank)
        answer["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                           "total_tokens": len(prompt) + len(tokens)}
        return JSON(answer)

    async def _stream(self, request: Request, gen: Generation, shape: _Shape) -> Response:
        try:
            first = await until_disconnect(request, gen.next_chunk())
        except BaseException:
            gen.close()  # no stream will
            raise
        events = _events(gen, shape, first)
        # Starlette stops iterating when the client hangs up but never closes the
        # iterator; closing it runs its finally, which aborts the request.
        return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(_close, events))


async def _events(gen: Generation, shape: _Shape, first: list[int] | None) -> AsyncGenerator[bytes, None]:
    decoder = tokenizer.StreamDecoder()
    chunk = first
    try:
        while chunk is not None:
            yield sse_event(shape.completion(decoder.feed(chunk), chunk, None, gen.rank))
            chunk = await gen.next_chunk()
        yield sse_event(shape.completion(decoder.flush(), [], gen.finish_reason, gen.rank))
        yield SSE_DONE
    except ApiError as exc:
        yield sse_event(exc.body())
    finally:
        gen.close()


async def _close(events: AsyncGenerator[bytes, None]) -> None:
    """Close the stream on the event loop (Starlette would run a bound ``aclose`` in a thread and drop it)."""
    await events.aclose()
