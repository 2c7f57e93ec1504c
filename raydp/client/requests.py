"""Client-side request state: one request's outputs, its future, its stream."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec

from raydp.errors import RaydpError, RequestError
from raydp.wire.protocol import Output, Request

Listener = Callable[["Output | RaydpError"], None]
# ClientTurns.read_for: poll the engine sockets for up to the given seconds, unless the check says the answer is in.
ReadFor = Callable[[float, Callable[[], bool]], bool]
logger = logging.getLogger("raydp.client.client")


@dataclass(frozen=True, slots=True)
class Submission:
    """A request on its way to the IO thread; ``rank`` set pins it.

    ``awaited``: a caller will wait on ``handle``, reading the engines' sockets
    itself while the client is quiet, so the IO thread need not be woken to
    watch them for this request.
    """

    request: Request
    rank: int | None
    listener: Listener
    retryable: bool
    handle: RequestHandle | None = None
    awaited: bool = False
    migrations: int = 0  # times the stream may move to another rank when its rank dies mid-stream
    whole: bool = False  # P/D: run it on one decode rank, never split over the pools (raydp.client.pools)


class RequestState:
    """Book-keeping of one in-flight request, owned by the client's IO thread.

    A migratable request (``migrations_left`` > 0) keeps what it streamed and
    its original request, so that the router can continue it on another rank
    (:meth:`continuation`).
    """

    __slots__ = (
        "got_output",
        "handle",
        "handoff",
        "listener",
        "migrations_left",
        "original",
        "rank",
        "request",
        "retryable",
        "streamed",
    )

    def __init__(
        self,
        request: Request,
        rank: int,
        listener: Listener,
        retryable: bool,
        handle: RequestHandle | None = None,
        migrations: int = 0,
    ) -> None:
        self.request, self.rank, self.listener, self.retryable = request, rank, listener, retryable
        self.handle = handle  # told which rank serves it, also after a failover
        self.got_output = False
        self.migrations_left = migrations
        self.original = request
        self.streamed: list[int] | None = [] if migrations else None
        self.handoff = False  # P/D: on a prefill rank, to move to a decode rank after its first token

    def prefill_first(self) -> None:
        """Send it to a prefill rank for its prompt and first token; it moves to a decode rank after."""
        self.handoff = True
        self.streamed = self.streamed if self.streamed is not None else []
        self.request = msgspec.structs.replace(self.original, max_tokens=1, prefill_only=True)

    def continuation(self) -> Request | None:
        """The request that goes on from the last streamed token (prompt + streamed, the tokens left), or None
        if nothing is left to generate."""
        streamed = self.streamed or []
        left = self.original.max_tokens - len(streamed)
        if left <= 0:
            return None
        prompt = [*self.original.prompt_token_ids, *streamed]
        return msgspec.structs.replace(self.original, prompt_token_ids=prompt, max_tokens=left)

    def deliver(self, item: Output | RaydpError) -> None:
        if isinstance(item, Output):
            self.got_output = True
            if self.streamed is not None:
                self.streamed.extend(item.token_ids)
        try:
            self.listener(item)
        except Exception:  # e.g. an asyncio listener whose loop has closed
            logger.exception("request %s: output listener failed", self.request.request_id)


class RequestHandle:
    """What :meth:`Client.submit` returns: wait for the result, or iterate the stream.

    ``result()`` returns every generated token; a failure raises the typed
    error (:class:`~raydp.errors.RequestError`, :class:`~raydp.errors.EngineDeadError`,
    :class:`~raydp.errors.ClusterClosedError`). Only token chunks are kept, so a
    long request costs its tokens and no more. ``result()`` may be awaited from
    any number of threads; ``stream()`` is meant for one consumer at a time
    (a second one still gets every chunk, possibly later).

    ``rank`` is the rank it runs on now; ``ranks``, every rank it ran on, in
    order: a P/D request's prefill rank then its decode rank, a migrated
    stream's ranks, a retry's.
    """

    def __init__(self, request_id: str, read_for: ReadFor | None = None) -> None:
        self.request_id = request_id
        self._read_for = read_for  # lets a waiter read its own answer (ClientTurns.read_for)
        self.rank: int | None = None
        self.ranks: list[int] = []
        self.finish_reason: str | None = None
        self.error: RaydpError | None = None
        self._chunks: list[list[int]] = []
        self._finished = False
        self._lock = threading.Lock()  # guards the fields above; never held while waiting
        # "There is news", as a binary semaphore: released by the IO thread, taken by
        # a waiter. A bare lock wakes a waiter in one hand-off; a Condition takes two
        # (the woken waiter then blocks again on the notifier's lock), which on a
        # sequential request was a third of the client's cost.
        self._news = threading.Lock()
        self._news.acquire()

    @property
    def tokens(self) -> list[int]:
        with self._lock:
            return [t for chunk in self._chunks for t in chunk]

    def deliver(self, item: Output | RaydpError) -> None:
        """Called from the client's IO thread."""
        if isinstance(item, Output) and item.error is not None:
            item = RequestError(item.request_id, item.error)
        with self._lock:
            if isinstance(item, Output):
                if item.token_ids:
                    self._chunks.append(item.token_ids)
                if item.finished:
                    self.finish_reason = item.finish_reason
                    self._finished = True
            else:
                self.error = item
                self._finished = True
        self._signal()

    def _signal(self) -> None:
        try:
            self._news.release()
        except RuntimeError:
            pass  # news already pending: the waiter will see this item too

    def _wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``ready()`` (checked under the lock); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if ready():
                    if self._finished:
                        self._signal()  # finished is final: let every other waiter see it too
                    return True
            remaining = -1.0 if deadline is None else deadline - time.monotonic()
            if deadline is not None and remaining <= 0:
                return False
            slice_s = 0.1 if remaining < 0 else remaining
            if self._read_for is not None and self._read_for(slice_s, lambda: self._ready(ready)):
                self._news.acquire(blocking=False)  # what it read is checked above; consume its news
                continue
            self._news.acquire(timeout=remaining)

    def _ready(self, ready: Callable[[], bool]) -> bool:
        with self._lock:
            return ready()

    def done(self) -> bool:
        return self._finished

    def result(self, timeout: float | None = None) -> list[int]:
        """All tokens, once finished; raises the request's error or TimeoutError."""
        if not self._wait(lambda: self._finished, timeout):
            raise TimeoutError(f"request {self.request_id!r} not finished after {timeout}s")
        if self.error is not None:
            raise self.error
        with self._lock:
            return [t for chunk in self._chunks for t in chunk]

    def stream(self, timeout: float | None = None) -> Iterator[list[int]]:
        """Yield each chunk of new tokens as it arrives; raises the request's error."""
        index = 0
        while True:
            chunks, finished = self._chunks_after(index, timeout)
            index += len(chunks)
            yield from chunks
            if finished and not chunks:
                if self.error is not None:
                    raise self.error
                return

    def _chunks_after(self, index: int, timeout: float | None) -> tuple[list[list[int]], bool]:
        if not self._wait(lambda: index < len(self._chunks) or self._finished, timeout):
            raise TimeoutError(f"request {self.request_id!r}: no output for {timeout}s")
        with self._lock:
            return [list(c) for c in self._chunks[index:]], self._finished
