"""``CoordinatorClient``: how a launcher tells the coordinator of deaths and restarts.

The coordinator republishes them in every snapshot, so clients in other
processes (API servers, attached notebooks) stop routing to a dead rank and
fail its in-flight requests, and follow a restarted rank to its new address.
"""

from __future__ import annotations

import logging
import threading

import zmq

from raydp.wire.endpoints import CoordinatorEndpoints
from raydp.wire.protocol import EngineDead, EngineRevived, encode
from raydp.wire.transport import SocketOptions, make_socket, pick_address

logger = logging.getLogger("raydp.coordinator")


class CoordinatorClient:
    """A PUSH socket to the coordinator's collect socket, safe to use from any thread."""

    def __init__(self, endpoints: CoordinatorEndpoints, node_id: str | None, opts: SocketOptions) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.PUSH, opts)
        self._sock.connect(pick_address(endpoints.collect, same_node=endpoints.node_id == node_id))
        self._lock = threading.Lock()

    def engine_dead(self, rank: int, cause: str) -> None:
        self._send(EngineDead(rank, cause))

    def engine_revived(self, rank: int, input_addresses: list[str]) -> None:
        self._send(EngineRevived(rank, input_addresses))

    def _send(self, msg: EngineDead | EngineRevived) -> None:
        """Send without blocking; never raises. A notice that cannot go is logged and dropped.

        It fails when the coordinator is gone (its own death is being reported
        separately), when its queue is full, or after ``close``.
        """
        body = encode(msg)
        with self._lock:
            try:
                self._sock.send(body, flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.warning(
                    "could not tell the coordinator %s(rank=%d): %s; other processes' clients will not see it",
                    type(msg).__name__,
                    msg.rank,
                    exc,
                )

    def close(self) -> None:
        with self._lock:
            self._ctx.destroy(linger=0)
