"""asyncio front-end over a :class:`~raydp.client.client.Client`, for API servers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from raydp.client.client import Client
from raydp.errors import ClusterClosedError, RaydpError, RequestError
from raydp.wire.protocol import Output


class AsyncClient:
    """asyncio front-end over a :class:`Client` (for API servers)."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def generate(self, prompt_token_ids: Sequence[int], max_tokens: int = 16, **kw: Any) -> list[int]:
        tokens: list[int] = []
        async for chunk in self.stream(prompt_token_ids, max_tokens, **kw):
            tokens.extend(chunk)
        return tokens

    async def stream(
        self, prompt_token_ids: Sequence[int], max_tokens: int = 16, **kw: Any
    ) -> AsyncIterator[list[int]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Output | RaydpError] = asyncio.Queue()

        def listener(item: Output | RaydpError) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        c = self.client
        request = c._make_request(prompt_token_ids, max_tokens, kw.get("rank"), kw.get("request_id"))
        c._submit(request, kw.get("rank"), listener, bool(kw.get("retryable", False)))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if not isinstance(item, Output):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestError(item.request_id, item.error)
                if item.token_ids:
                    yield list(item.token_ids)
        finally:
            if not finished:  # the consumer went away (e.g. an HTTP client hung up)
                with contextlib.suppress(ClusterClosedError):
                    c.abort(request.request_id)
