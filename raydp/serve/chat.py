"""OpenAI's ``POST /v1/chat/completions``, over the server's tokenizer's chat template.

The prompt is the tokenizer's chat template applied to ``messages``, with the
generation prompt (where the assistant's answer starts). The answer is a
``chat.completion`` (``choices[0].message``: ``{"role": "assistant",
"content"}``, the ``finish_reason``, ``usage``), or with ``"stream": true`` a
stream of ``chat.completion.chunk`` events: a first delta with the role, then
content deltas, a last chunk with the ``finish_reason`` (and a usage chunk if
``stream_options.include_usage``), then ``data: [DONE]`` (:mod:`.text_answer`).
Choices also carry ``rank``, and the whole answer's ``token_ids``, as in completions.

A server without a chat template (the byte tokenizer's case) answers 400.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from raydp.errors import ConfigError
from raydp.serve.api_errors import ApiError
from raydp.serve.bodies import ChatBody
from raydp.serve.completions import GenerationRoutes
from raydp.serve.text_answer import Envelope, answer
from raydp.text.stream import Piece


class ChatShape:
    """OpenAI's ``chat.completion`` object and ``chat.completion.chunk`` events."""

    def __init__(self, whole: Envelope, chunks: Envelope) -> None:
        self._whole, self._chunks = whole, chunks

    def whole(self, text: str, token_ids: list[int], finish_reason: str, rank: int | None) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
            "token_ids": token_ids,
            "rank": rank,
        }
        return self._whole.wrap([choice])

    def _delta(self, delta: dict[str, str], finish_reason: str | None, rank: int | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, "rank": rank}
        return self._chunks.wrap([choice])

    def opening(self, rank: int | None) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, None, rank)]

    def chunk(self, piece: Piece, rank: int | None) -> dict[str, Any] | None:
        # Tokens still without text (half a character, or held back as the start of a stop string) send nothing.
        return self._delta({"content": piece.text}, None, rank) if piece.text else None

    def closing(self, finish_reason: str, rank: int | None) -> dict[str, Any]:
        return self._delta({}, finish_reason, rank)

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return self._chunks.wrap([], usage=usage)


class ChatRoute:
    """The handler, over the routes that start generations (:class:`GenerationRoutes`)."""

    def __init__(self, routes: GenerationRoutes) -> None:
        self.routes = routes

    async def completions(self, request: Request) -> Response:
        routes = self.routes
        body = await routes.read(request, ChatBody)
        include_usage = body.include_usage()
        prompt = self._prompt(body)
        gen = routes.start_text(body, prompt, body.max_new_tokens(routes.limits.max_tokens))
        created, rid, model = int(time.time()), f"chatcmpl-{gen.request_id}", routes.limits.model
        shape = ChatShape(
            Envelope(rid, "chat.completion", created, model), Envelope(rid, "chat.completion.chunk", created, model)
        )
        return await answer(request, gen, shape, stream=body.stream, include_usage=include_usage)

    def _prompt(self, body: ChatBody) -> list[int]:
        tokenizer = self.routes.tokenizer
        if not tokenizer.has_chat_template:
            raise ApiError(
                400,
                f"this server's tokenizer, {tokenizer.name}, has no chat template, so it serves "
                "no chat; start it with a tokenizer that has one (raydp serve --tokenizer DIR)",
                code="chat_template_missing",
            )
        try:
            return tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="messages") from None
