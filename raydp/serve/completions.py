"""The generation routes: OpenAI's ``POST /v1/completions`` and raydp's ``POST /v1/generate``.

``/v1/completions`` answers in OpenAI's ``text_completion`` shape; each
choice also carries ``token_ids`` (the generated ids) and ``rank`` (the rank
that served it), raydp extensions. With ``"stream": true`` it answers with
server-sent events, one ``data: {chunk}`` per engine output, a last chunk with
the ``finish_reason``, then ``data: [DONE]`` (:mod:`.text_answer`).

``/v1/generate`` takes ``{"prompt_token_ids", "max_tokens", "rank"?}`` and
answers ``{"token_ids": [...]}``.

A string prompt is encoded with the server's tokenizer (:mod:`raydp.text`:
the byte tokenizer unless the server was given one), and the output is
detokenized incrementally and cut at the request's stop strings.
:class:`GenerationRoutes` also starts the chat route's generations
(:mod:`.chat`), with the same checks.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from raydp.client.aio import AsyncClient
from raydp.serve.api_errors import ApiError
from raydp.serve.bodies import CompletionBody, GenerateBody, Limits, TextBody, parse, read_body
from raydp.serve.draining import InFlight
from raydp.serve.generation import Generation, until_disconnect
from raydp.serve.metrics import ApiMetrics
from raydp.serve.responses import JSON
from raydp.serve.text_answer import Envelope, TextGeneration, answer
from raydp.text.stream import Piece, TextStream
from raydp.text.tokenizer import TextTokenizer
from raydp.wire.sampling import Sampling

T = TypeVar("T", bound=TextBody)


class CompletionShape:
    """OpenAI's ``text_completion`` objects and chunks, with raydp's ``token_ids`` and ``rank``."""

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope

    def _choice(self, text: str, token_ids: list[int], finish_reason: str | None, rank: int | None) -> dict[str, Any]:
        choice = {
            "text": text,
            "index": 0,
            "logprobs": None,
            "finish_reason": finish_reason,
            "token_ids": token_ids,
            "rank": rank,
        }
        return self.envelope.wrap([choice])

    def whole(self, text: str, token_ids: list[int], finish_reason: str, rank: int | None) -> dict[str, Any]:
        return self._choice(text, token_ids, finish_reason, rank)

    def opening(self, rank: int | None) -> list[dict[str, Any]]:
        return []

    def chunk(self, piece: Piece, rank: int | None) -> dict[str, Any] | None:
        # A piece with tokens but no text yet (half a character) still reports its ids.
        return self._choice(piece.text, piece.token_ids, None, rank) if piece.text or piece.token_ids else None

    def closing(self, finish_reason: str, rank: int | None) -> dict[str, Any]:
        return self._choice("", [], finish_reason, rank)

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return self.envelope.wrap([], usage=usage)


class GenerationRoutes:
    """The handlers of both routes over one :class:`AsyncClient`, and the start of every text generation."""

    def __init__(
        self,
        aclient: AsyncClient,
        limits: Limits,
        max_body_bytes: int,
        timeout_s: float,
        metrics: ApiMetrics,
        in_flight: InFlight,
        tokenizer: TextTokenizer,
    ) -> None:
        self.aclient, self.limits, self.max_body_bytes = aclient, limits, max_body_bytes
        self.timeout_s, self.metrics, self.in_flight = timeout_s, metrics, in_flight
        self.tokenizer = tokenizer

    def _start(
        self, prompt: list[int], max_tokens: int, rank: int | None, sampling: Sampling | None = None
    ) -> Generation:
        self.limits.check_max_tokens(max_tokens)
        self.limits.check_rank(rank)
        return Generation(
            self.aclient, prompt, max_tokens, rank, self.timeout_s, self.metrics, self.in_flight, sampling
        )

    async def read(self, request: Request, model: type[T]) -> T:
        """The request's body as ``model``, for this server's model."""
        body = parse(model, await read_body(request, self.max_body_bytes))
        self.limits.check_model(body.model)
        return body

    def start_text(self, body: TextBody, prompt: list[int], max_tokens: int) -> TextGeneration:
        """Check what ``body`` asks beyond its own fields, then send the request."""
        if body.stop_token_ids:
            self.limits.check_token_ids(body.stop_token_ids, "stop_token_ids")
        sampling = body.sampling()
        stream = TextStream(self.tokenizer.detokenizer(), body.stops())
        return TextGeneration(self._start(prompt, max_tokens, body.rank, sampling), stream, len(prompt))

    async def generate(self, request: Request) -> Response:
        body = parse(GenerateBody, await read_body(request, self.max_body_bytes))
        self.limits.check_token_ids(body.prompt_token_ids, "prompt_token_ids")
        gen = self._start(body.prompt_token_ids, body.max_tokens, body.rank)
        try:
            return JSON({"token_ids": await until_disconnect(request, gen.collect())})
        finally:
            gen.close()

    async def completions(self, request: Request) -> Response:
        body = await self.read(request, CompletionBody)
        include_usage = body.include_usage()
        if isinstance(body.prompt, str):
            prompt = self.tokenizer.encode(body.prompt)
            if not prompt:
                raise ApiError(
                    400,
                    f"prompt={body.prompt[:80]!r}: {self.tokenizer.name} encodes it to no tokens; "
                    "must encode to at least one",
                    param="prompt",
                )
        else:
            prompt = body.prompt
            self.limits.check_token_ids(prompt, "prompt")
        gen = self.start_text(body, prompt, body.max_tokens)
        envelope = Envelope(f"cmpl-{gen.request_id}", "text_completion", int(time.time()), self.limits.model)
        return await answer(request, gen, CompletionShape(envelope), stream=body.stream, include_usage=include_usage)
