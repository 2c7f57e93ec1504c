"""``CoordinatorClient``: how a launcher tells the coordinator of deaths and restarts.

The coordinator republishes them in every snapshot, so clients in other
processes (API servers, attached notebooks) stop routing to a dead rank and
fail its in-flight requests, and follow a restarted rank to its new address.
"""

from __future__ import annotations

import logging
import threading

import zmq

from raydp.wire.codec import encode
from raydp.wire.control import (
    EngineDead,
    EngineRevived,
    HoldCluster,
    RegroupCluster,
    ReleaseCluster,
    ScaleEngines,
    ToCoordinator,
)
from raydp.wire.endpoints import CoordinatorEndpoints
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

    def engine_revived(self, rank: int, input_addresses: list[str], node_id: str = "") -> None:
        self._send(EngineRevived(rank, input_addresses, node_id))

    def scale(self, engine_count: int, size: int, prefill: int = -1) -> None:
        self._send(ScaleEngines(engine_count, size, prefill))

    def hold(self, epoch: int, gang: int) -> None:
        self._send(HoldCluster(epoch, gang))

    def regroup(self, epoch: int, dp_size: int, dp_master: str) -> None:
        self._send(RegroupCluster(epoch, dp_size, dp_master))

    def release(self, epoch: int) -> None:
        self._send(ReleaseCluster(epoch))

    def _send(self, msg: ToCoordinator) -> None:
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
                    "could not tell the coordinator %r: %s; other processes' clients will not see it", msg, exc
                )

    def close(self) -> None:
        with self._lock:
            self._ctx.destroy(linger=0)
