"""asyncio front-end over a :class:`~raydp.client.client.Client`, for API servers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from raydp.client.client import Client
from raydp.client.requests import RequestHandle, Submission
from raydp.errors import ClusterClosedError, RaydpError, RequestError
from raydp.wire.protocol import Output


class AsyncRequest:
    """One request sent by :meth:`AsyncClient.submit`; iterate it for its token chunks.

    ``rank`` is the rank serving it (None until the client's IO thread sent it,
    updated after a failover); ``finish_reason`` is set once the iteration
    ended normally. Iteration raises the request's typed error. :meth:`close`
    aborts it on its engine unless it finished: call it when giving up early
    (a cancelled ``__anext__`` does not abort by itself).
    """

    def __init__(self, client: Client, prompt_token_ids: Sequence[int], max_tokens: int, kw: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Output | RaydpError] = asyncio.Queue()

        def listener(item: Output | RaydpError) -> None:
            # A closed loop has nobody waiting: a server that stopped, whose aborts the engine now confirms.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._queue.put_nowait, item)

        self._client = client
        rank, sampling, adapter = kw.get("rank"), kw.get("sampling"), kw.get("adapter", "")
        request = client.request_for(prompt_token_ids, max_tokens, rank, kw.get("request_id"), sampling, adapter)
        self.request_id = request.request_id
        # The IO thread records the serving rank on a handle; its outputs go to the listener.
        self._handle = RequestHandle(request.request_id)
        self.finish_reason: str | None = None
        self._finished = False
        moves = client.migrations_for(kw.get("migratable", False), kw.get("rank"))
        self.submission = Submission(
            request, kw.get("rank"), listener, bool(kw.get("retryable", False)), self._handle, migrations=moves
        )

    @property
    def rank(self) -> int | None:
        return self._handle.rank

    @property
    def ranks(self) -> list[int]:
        """Every rank it ran on, in order (see :class:`~raydp.client.requests.RequestHandle`)."""
        return list(self._handle.ranks)

    def __aiter__(self) -> AsyncRequest:
        return self

    async def __anext__(self) -> list[int]:
        while not self._finished:
            item = await self._queue.get()
            if not isinstance(item, Output):
                self._finished = True
                raise item
            self._finished = item.finished
            if item.error is not None:
                raise RequestError(item.request_id, item.error)
            if item.finished:
                self.finish_reason = item.finish_reason
            if item.token_ids:
                return list(item.token_ids)
        raise StopAsyncIteration

    def fail(self, error: RaydpError) -> None:
        """End the iteration with ``error``, after the chunks already received, and abort the request on its
        engine; nothing if it has finished. Call it on the event loop (a server that stops waiting)."""
        if self._finished:
            return
        self._queue.put_nowait(error)
        with contextlib.suppress(ClusterClosedError):
            self._client.abort(self.request_id)

    def close(self) -> None:
        """Abort the request on its engine if it has not finished (idempotent)."""
        if not self._finished:
            self._finished = True
            with contextlib.suppress(ClusterClosedError):
                self._client.abort(self.request_id)


class LoopBatch:
    """Submissions made in one turn of an event loop, sent together at its end.

    An API server's concurrent HTTP requests then leave together: one
    hand-off to the client's IO thread and one message per rank, as with
    :meth:`Client.submit_many`. Use it on the event loop's thread only.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self._pending: list[Submission] = []

    def add(self, item: Submission) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(item)

    def _flush(self) -> None:
        items, self._pending = self._pending, []
        try:
            self.client.send_batch(items)
        except RaydpError as exc:  # the client closed: every request of the batch learns it
            for item in items:
                item.listener(exc)


class AsyncClient:
    """asyncio front-end over a :class:`Client` (for API servers).

    Requests submitted in the same turn of the event loop leave together
    (:class:`LoopBatch`).
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self._batch = LoopBatch(client)

    def submit(self, prompt_token_ids: Sequence[int], max_tokens: int = 16, **kw: Any) -> AsyncRequest:
        """Send one request (from a running event loop) at the end of this loop turn; see :class:`AsyncRequest`."""
        request = AsyncRequest(self.client, prompt_token_ids, max_tokens, kw)
        self._batch.add(request.submission)
        return request

    def submit_many(self, prompts: Sequence[Sequence[int]], max_tokens: int = 16, **kw: Any) -> list[AsyncRequest]:
        """Send many requests together (from a running event loop); one :class:`AsyncRequest` each."""
        return [self.submit(prompt, max_tokens, **kw) for prompt in prompts]

    async def generate(self, prompt_token_ids: Sequence[int], max_tokens: int = 16, **kw: Any) -> list[int]:
        tokens: list[int] = []
        async for chunk in self.stream(prompt_token_ids, max_tokens, **kw):
            tokens.extend(chunk)
        return tokens

    async def stream(
        self, prompt_token_ids: Sequence[int], max_tokens: int = 16, **kw: Any
    ) -> AsyncIterator[list[int]]:
        request = self.submit(prompt_token_ids, max_tokens, **kw)
        try:
            async for chunk in request:
                yield chunk
        finally:
            request.close()  # the consumer went away (e.g. an HTTP client hung up): abort
