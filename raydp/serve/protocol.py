"""uvicorn's h11 HTTP protocol with the two connection timers uvicorn lacks.

uvicorn (0.54) times a connection out only between requests, with
``timeout_keep_alive``, armed when a response completes and cancelled by the
next byte in. So a connection that never sends a byte, or that trickles a
request one byte at a time (slow loris), holds its slot forever;
``h11_max_incomplete_event_size`` only bounds the head's size, and
``limit_concurrency`` turns *other* clients away once such connections pile
up. :class:`GuardedH11Protocol` adds:

* **idle from the start**: a new connection gets uvicorn's idle timer at
  once, as a kept-alive one does after each response;
* **a read deadline**: from a request's first byte, its head and its body
  must arrive within ``read_timeout_s``, or the connection is closed. The
  deadline stops once the request is in; generating the answer is the app's
  time (``request_timeout_s``), never cut by it;
* **malformed requests in the API's shape**: a request line, header or body
  framing that h11 cannot parse gets a 400 in OpenAI's JSON error shape
  (uvicorn's is plain text), and the connection closes. It is logged once,
  naming the client's address, at most once a second per address
  (:class:`~raydp.wire.dropped.DropLog`) instead of uvicorn's line per request;
* **over capacity in the API's shape**: past ``limit_concurrency`` open
  connections (or running requests), a request gets a 503 in OpenAI's JSON
  error shape (code ``server_overloaded``) where uvicorn's is plain text,
  logged at most once a second.

A guarded class is made per setting by :func:`guarded_protocol` (uvicorn
builds protocols from a class and its config only).
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar, Final

import h11
import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from raydp.serve.api_errors import ApiError
from raydp.wire.dropped import DropLog

logger = logging.getLogger("raydp.serve")
UVICORN_MALFORMED = "Invalid HTTP request received."  # uvicorn's message (and log line) for what h11 refuses
MALFORMED_BODY = msgspec.json.encode(
    ApiError(
        400,
        "malformed HTTP request: the request line, a header or the body framing is not valid HTTP/1.1",
        code="malformed_request",
    ).body()
)


class _NotUvicornsMalformedLine(logging.Filter):
    """uvicorn logs every malformed request with no sender; :meth:`GuardedH11Protocol.send_400_response` does."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != UVICORN_MALFORMED


QUIET_MALFORMED: Final = _NotUvicornsMalformedLine()


OVERLOADED = ApiError(
    503,
    "the API server is at its connection limit (max_connections); retry shortly",
    code="server_overloaded",
    headers={"Connection": "close"},
)


class GuardedH11Protocol(H11Protocol):
    """See the module docstring; ``read_timeout_s`` is set by :func:`guarded_protocol`."""

    read_timeout_s: ClassVar[float] = 10.0
    drops: ClassVar[DropLog] = DropLog(logger, "api server", what="malformed HTTP request")
    overloads: ClassVar[DropLog] = DropLog(logger, "api server", what="request over max_connections")
    _read_deadline: asyncio.TimerHandle | None = None

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # uvicorn's own cap answers in plain text: take it over, with the same bound.
        limit, self.limit_concurrency = self.limit_concurrency, None
        if limit is not None:
            self.app = self._capped(self.app, limit)

    def _capped(self, app: ASGIApp, limit: int) -> ASGIApp:
        async def capped(scope: Scope, receive: Receive, send: Send) -> None:
            # uvicorn counts before adding the request's task; here it is among the tasks already.
            if scope["type"] == "http" and (len(self.connections) >= limit or len(self.tasks) > limit):
                self.overloads.drop(
                    f"HTTP client {self.client[0] if self.client else 'unknown'}",
                    f"{len(self.connections)} connections, limit {limit}",
                )
                await OVERLOADED.response()(scope, receive, send)
                return
            await app(scope, receive, send)

        return capped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already buffered
        self._update_read_deadline()

    def send_400_response(self, msg: str) -> None:
        """What h11 refused (``msg`` is uvicorn's): the API's 400, unless an answer is under way; then close."""
        self.drops.drop(f"HTTP client {self.client[0] if self.client else 'unknown'}", msg)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(MALFORMED_BODY)),
                (b"connection", b"close"),
            ]
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=MALFORMED_BODY),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_deadline()
        super().connection_lost(exc)

    def _update_read_deadline(self) -> None:
        """Run the deadline while a request is partly in: some of its head, or not all its body."""
        state = self.conn.their_state
        receiving = state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))
        if not receiving or self.transport.is_closing():
            self._stop_read_deadline()
        elif self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _stop_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            logger.debug("closing %s: its request did not arrive within %gs", self.client, self.read_timeout_s)
            self.transport.close()


def guarded_protocol(read_timeout_s: float) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` class whose requests must arrive within ``read_timeout_s``.

    Each class counts its own dropped requests (one server's, on its event loop's thread).
    """
    drops = DropLog(logger, "api server", what="malformed HTTP request")
    overloads = DropLog(logger, "api server", what="request over max_connections")
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"read_timeout_s": read_timeout_s, "drops": drops, "overloads": overloads},
    )
