"""Answering a text route (completions, chat): tokens as text, whole or streamed, cut at stop strings.

:class:`TextGeneration` turns a :class:`~raydp.serve.generation.Generation`'s
token chunks into text pieces (:class:`~raydp.text.stream.TextStream`:
incremental detokenizing, then the request's stop strings). Stop strings are
the API server's to apply, not the engine's: once one completes, the text
ends before it, the finish reason is ``stop``, and the request is aborted on
its engine, which would otherwise go on to ``max_tokens``.

:func:`answer` sends the text in the route's :class:`Shape`: one JSON object
with ``usage``, or server-sent events (the route's opening events, one chunk
per piece of text, a closing chunk with the ``finish_reason``, a usage chunk
if ``stream_options.include_usage`` asked for it, then ``data: [DONE]``).
The first piece is awaited before the answer starts, so a dead rank or a
timeout before any token still gets its own status; a failure after that is
sent as one ``data: {"error": ...}`` event (which OpenAI's SDKs raise), and
the stream ends. A client that hangs up, mid-stream or while waiting, aborts
its request on its engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from raydp.serve.api_errors import ApiError
from raydp.serve.generation import Generation, until_disconnect
from raydp.serve.responses import JSON, SSE_DONE, sse_event
from raydp.text.stream import Piece, TextStream


@dataclass(frozen=True)
class Envelope:
    """The fields every answer object and chunk of one request share."""

    id: str
    object: str
    created: int
    model: str

    def wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


class Shape(Protocol):
    """How one route writes its answer: whole, or as stream chunks."""

    def whole(self, text: str, token_ids: list[int], finish_reason: str, rank: int | None) -> dict[str, Any]: ...

    def opening(self, rank: int | None) -> list[dict[str, Any]]:
        """The chunks a stream starts with, before any text."""
        ...

    def chunk(self, piece: Piece, rank: int | None) -> dict[str, Any] | None:
        """The chunk for one piece of text, or None if it has nothing to send."""
        ...

    def closing(self, finish_reason: str, rank: int | None) -> dict[str, Any]: ...

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        """The stream's last chunk, with the usage (``stream_options.include_usage``)."""
        ...


class TextGeneration:
    """A :class:`Generation` whose tokens come out as text pieces; see the module docstring."""

    def __init__(self, gen: Generation, stream: TextStream, prompt_tokens: int) -> None:
        self.gen, self._stream, self.prompt_tokens = gen, stream, prompt_tokens
        self.token_ids: list[int] = []  # the tokens the text covers: none past a stop string
        self._ended = False

    @property
    def request_id(self) -> str:
        return self.gen.request.request_id

    @property
    def rank(self) -> int | None:
        return self.gen.rank

    @property
    def finish_reason(self) -> str:
        return "stop" if self._stream.stopped else self.gen.finish_reason

    async def next_piece(self) -> Piece | None:
        """The next piece of text (possibly empty), or None once the text has ended."""
        if self._ended:
            return None
        chunk = None if self._stream.stopped else await self.gen.next_chunk()
        if chunk is None:
            self._ended = True
            return self._stream.finish()
        piece = self._stream.feed(chunk)
        self.token_ids.extend(piece.token_ids)
        if piece.stopped:
            self.gen.close()  # the engine would go on past the stop string, to max_tokens
        return piece

    async def collect(self) -> str:
        texts = []
        while (piece := await self.next_piece()) is not None:
            texts.append(piece.text)
        return "".join(texts)

    def usage(self) -> dict[str, int]:
        done = len(self.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }

    def close(self) -> None:
        self.gen.close()


async def answer(
    request: Request, gen: TextGeneration, shape: Shape, *, stream: bool, include_usage: bool = False
) -> Response:
    """The route's response: see the module docstring. Closes ``gen`` however it ends."""
    if stream:
        return await _stream(request, gen, shape, include_usage)
    try:
        text = await until_disconnect(request, gen.collect())
    finally:
        gen.close()
    whole = shape.whole(text, gen.token_ids, gen.finish_reason, gen.rank)
    whole["usage"] = gen.usage()
    return JSON(whole)


async def _stream(request: Request, gen: TextGeneration, shape: Shape, include_usage: bool) -> Response:
    try:
        first = await until_disconnect(request, gen.next_piece())
    except BaseException:
        gen.close()  # no stream will
        raise
    events = _events(gen, shape, first, include_usage)
    # Starlette stops iterating when the client hangs up but never closes the
    # iterator; closing it runs its finally, which aborts the request.
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(_close, events))


async def _events(
    gen: TextGeneration, shape: Shape, first: Piece | None, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    extra = {"usage": None} if include_usage else {}  # OpenAI's chunks say so when a usage chunk follows
    piece = first
    try:
        for opening in shape.opening(gen.rank):
            yield sse_event({**opening, **extra})
        while piece is not None:
            chunk = shape.chunk(piece, gen.rank)
            if chunk is not None:
                yield sse_event({**chunk, **extra})
            piece = await gen.next_piece()
        yield sse_event({**shape.closing(gen.finish_reason, gen.rank), **extra})
        if include_usage:
            yield sse_event(shape.usage(gen.usage()))
        yield SSE_DONE
    except ApiError as exc:
        yield sse_event(exc.body())
    finally:
        gen.close()


async def _close(events: AsyncGenerator[bytes, None]) -> None:
    """Close the stream on the event loop (Starlette would run a bound ``aclose`` in a thread and drop it)."""
    await events.aclose()
