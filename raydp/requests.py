"""Client-side request state: one request's outputs, its future, its stream."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

from raydp.errors import RaydpError, RequestError
from raydp.protocol import Output, Request

Listener = Callable[["Output | RaydpError"], None]
logger = logging.getLogger("raydp.client")


class RequestState:
    """Book-keeping of one in-flight request, owned by the client's IO thread."""

    __slots__ = ("got_output", "listener", "rank", "request", "retryable")

    def __init__(self, request: Request, rank: int, listener: Listener, retryable: bool) -> None:
        self.request, self.rank, self.listener, self.retryable = request, rank, listener, retryable
        self.got_output = False

    def deliver(self, item: Output | RaydpError) -> None:
        if isinstance(item, Output):
            self.got_output = True
        try:
            self.listener(item)
        except Exception:  # e.g. an asyncio listener whose loop has closed
            logger.exception("request %s: output listener failed", self.request.request_id)


class RequestHandle:
    """What :meth:`Client.submit` returns: wait for the result, or iterate the stream.

    ``result()`` returns every generated token; a failure raises the typed
    error (:class:`~raydp.errors.RequestError`, :class:`~raydp.errors.EngineDeadError`,
    :class:`~raydp.errors.ClusterClosedError`).
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.rank: int | None = None
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: RaydpError | None = None
        self._done = threading.Event()
        self._stream: queue.SimpleQueue[Output | RaydpError] = queue.SimpleQueue()

    def _on_item(self, item: Output | RaydpError) -> None:
        """Called from the client's IO thread."""
        if isinstance(item, Output) and item.error is not None:
            item = RequestError(item.request_id, item.error)
        if isinstance(item, Output):
            self.tokens.extend(item.token_ids)
            if item.finished:
                self.finish_reason = item.finish_reason
        else:
            self.error = item
        self._stream.put(item)
        if not isinstance(item, Output) or item.finished:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> list[int]:
        """All tokens, once finished; raises the request's error or TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} not finished after {timeout}s")
        if self.error is not None:
            raise self.error
        return list(self.tokens)

    def stream(self, timeout: float | None = None) -> Iterator[list[int]]:
        """Yield each batch of new tokens as it arrives."""
        while True:
            try:
                item = self._stream.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id!r}: no output for {timeout}s") from None
            if not isinstance(item, Output):
                raise item
            if item.token_ids:
                yield list(item.token_ids)
            if item.finished:
                return

