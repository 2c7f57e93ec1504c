"""Stopping an API server without cutting its requests off.

A stopping server (:func:`~raydp.serve.server.serve_on_socket`) stops
accepting at once, closes its idle connections, and gives the requests it is
running ``graceful_shutdown_s`` to finish. Then :meth:`InFlight.fail_all`
ends the rest with :class:`ShuttingDownError`, which the routes answer as a
503 in OpenAI's error shape (``code: "shutting_down"``): a plain request as
its response, a stream already started as a last ``data: {"error": ...}``
event and the end of the stream; each is aborted on its engine. Those
answers get ``FLUSH_S`` to go out (a client that stopped reading holds its
connection no longer), then the server ends its client and exits: all
within :func:`stop_bound_s`, which is how long a launcher waits for it
before killing it. A request that reaches the server's client after
``fail_all`` gets the same 503 at once.

Nothing here needs the engines: the launcher stops its API servers first,
and ends the engines once they have answered.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

from raydp.errors import ShuttingDownError

if TYPE_CHECKING:
    from raydp.client.aio import AsyncRequest

logger = logging.getLogger("raydp.serve")
FLUSH_S = 2.0  # after fail_all: for the 503s and last stream events to go out
CLOSE_S = 3.0  # then: the app's shutdown and the server's client closing


def stop_bound_s(graceful_shutdown_s: float) -> float:
    """The longest an API server takes from a stop signal to its exit."""
    return graceful_shutdown_s + FLUSH_S + CLOSE_S


class InFlight:
    """The requests an API server's routes are running, so that a stop can end them with an answer.

    Used on the server's event loop only.
    """

    def __init__(self) -> None:
        # Weak: a stream whose body never started iterating is never closed, and must not stay here.
        self._live: weakref.WeakSet[AsyncRequest] = weakref.WeakSet()
        self._reason: str | None = None

    def check_open(self) -> None:
        """Raise :class:`ShuttingDownError` once :meth:`fail_all` ran (a request must not start then)."""
        if self._reason is not None:
            raise ShuttingDownError(self._reason)

    def add(self, request: AsyncRequest) -> None:
        self._live.add(request)

    def discard(self, request: AsyncRequest) -> None:
        self._live.discard(request)

    def fail_all(self, reason: str) -> None:
        """End every request still running with :class:`ShuttingDownError` (``reason``), and any that comes later."""
        self._reason = reason
        live, self._live = list(self._live), weakref.WeakSet()
        if live:
            logger.warning("%s: ending %d request(s) still running with a 503", reason, len(live))
        for request in live:
            request.fail(ShuttingDownError(reason))
