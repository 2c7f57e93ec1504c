"""A rank's outputs on their way to clients: sends never block, and nothing is dropped silently.

Each client whose queue is full gets a backlog of its own, flushed between
steps, so a slow client cannot stall the others of the rank. A client that
falls :data:`BACKLOG_LIMIT` batches behind, or disconnects, is given up: its
backlog goes and the loop is told (``on_lost``), which aborts its requests.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Protocol

import zmq

BACKLOG_LIMIT = 10_000  # output batches a slow client may fall behind before it is dropped


class _Sender(Protocol):
    def send_to(self, client: bytes, body: bytes) -> None: ...


class Outbox:
    """Non-blocking sends to clients, with a backlog per client whose queue is full."""

    def __init__(self, sender: _Sender, on_lost: Callable[[bytes, str], None]) -> None:
        self._sender, self._on_lost = sender, on_lost
        self._backlog: dict[bytes, collections.deque[bytes]] = {}

    @property
    def behind(self) -> bool:
        """Some client's outputs still wait to be sent."""
        return bool(self._backlog)

    def send(self, client: bytes, body: bytes) -> None:
        backlog = self._backlog.get(client)
        if backlog is not None:  # behind already: in order, after what waits
            backlog.append(body)
            if len(backlog) > BACKLOG_LIMIT:
                self._lose(client, f"{len(backlog)} output batches behind")
            return
        if not self._try_send(client, body):
            self._backlog[client] = collections.deque([body])

    def flush(self) -> None:
        for client, backlog in list(self._backlog.items()):
            while backlog and self._try_send(client, backlog[0]):
                backlog.popleft()
            if not backlog:
                self._backlog.pop(client, None)

    def _try_send(self, client: bytes, body: bytes) -> bool:
        """Send now if the client's queue has room; False if it is full."""
        try:
            self._sender.send_to(client, body)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._lose(client, "disconnected")
        return True

    def _lose(self, client: bytes, why: str) -> None:
        self._backlog.pop(client, None)
        self._on_lost(client, why)
