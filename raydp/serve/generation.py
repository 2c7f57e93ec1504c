"""One generation as an HTTP route serves it: a deadline, typed errors, metrics, hang-ups.

:class:`Generation` sends the request at construction and hands out its token
chunks; every failure comes out as an :class:`~raydp.serve.api_errors.ApiError`
(503 dead rank, 504 past the deadline, ...). :meth:`Generation.close` aborts
the request on its engine unless it finished: every route calls it when it is
done, however it is done, so a request nobody waits for stops using the engine.

:func:`until_disconnect` runs a step of the route while watching the
connection: a client that hangs up cancels it (:class:`ClientGoneError`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from starlette.requests import Request

from raydp.client.aio import AsyncClient
from raydp.errors import RaydpError
from raydp.serve.api_errors import ApiError, from_raydp_error
from raydp.serve.draining import InFlight
from raydp.serve.metrics import ApiMetrics
from raydp.wire.sampling import Sampling

T = TypeVar("T")


class ClientGoneError(RaydpError):
    """The HTTP client hung up before its answer."""


class Generation:
    """A request in flight for one HTTP request; see the module docstring."""

    def __init__(
        self,
        aclient: AsyncClient,
        prompt: Sequence[int],
        max_tokens: int,
        rank: int | None,
        timeout_s: float,
        metrics: ApiMetrics,
        in_flight: InFlight,
        sampling: Sampling | None = None,
    ) -> None:
        self.started = time.perf_counter()
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._got_first = False
        self._in_flight = in_flight
        try:
            in_flight.check_open()
            # An unpinned request that has produced nothing yet moves to a live rank if its rank dies:
            # the caller sees an answer, not a 503, for a death it could not have seen coming. With
            # --migration-limit, one that has streamed moves too, from its last token.
            migratable = rank is None and aclient.client.migration_limit > 0
            self.request = aclient.submit(
                prompt, max_tokens, rank=rank, sampling=sampling, retryable=rank is None, migratable=migratable
            )
        except RaydpError as exc:
            raise from_raydp_error(exc) from None
        in_flight.add(self.request)  # a stopping server ends it with a 503 (shutting_down)

    @property
    def rank(self) -> int | None:
        return self.request.rank

    @property
    def finish_reason(self) -> str:
        return self.request.finish_reason or "stop"

    async def next_chunk(self) -> list[int] | None:
        """The next token chunk, or None once the request finished."""
        remaining = self._deadline - time.monotonic()
        try:
            chunk = await asyncio.wait_for(self.request.__anext__(), max(remaining, 0.0))
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            self.close()
            raise ApiError(504, f"the request ran past request_timeout_s={self._timeout_s:g}", code="timeout") from None
        except RaydpError as exc:
            raise from_raydp_error(exc) from None
        if not self._got_first:
            self._got_first = True
            self._metrics.first_token.observe(time.perf_counter() - self.started)
        self._metrics.tokens.inc(len(chunk))
        return chunk

    async def collect(self) -> list[int]:
        tokens: list[int] = []
        while (chunk := await self.next_chunk()) is not None:
            tokens.extend(chunk)
        return tokens

    def close(self) -> None:
        self.request.close()
        self._in_flight.discard(self.request)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client hangs up first: then ``work`` is cancelled and
    :class:`ClientGoneError` raised. Only for after the body was read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGoneError


async def _disconnected(request: Request) -> None:
    # With the body read, the server's next message is the hang-up.
    while (await request.receive())["type"] != "http.disconnect":
        pass
