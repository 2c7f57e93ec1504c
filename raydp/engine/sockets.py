"""The sockets of one running rank, and how its loop waits on them.

* ``input`` ROUTERs (bound): ``[client_id, tag, body]`` from clients; outputs go
  back to the owning client as ``[client_id, OutputBatch]`` on the socket it
  is connected to. One ROUTER, or, with CURVE, a plain one for same-node IPC clients
  and a CURVE one for TCP clients, so local traffic skips the encryption that
  only the network needs;
* ``collect`` PUSH to the coordinator: load, ``WaveComplete``, ``StartWave``;
* ``broadcast`` SUB from the coordinator: ``Shutdown``, ``Resync``, and for
  lockstep ranks ``StartDPWave``, ``Hold``, ``Regroup``, ``Release``;
* a doorbell (a pipe): another thread of the process wakes the loop to stop.

The loop waits on them with one ``poll()`` of their ``ZMQ_FD``s
(:mod:`raydp.wire.polling`), not ``zmq_poll``, whose per-socket checks cost
more system calls than the request being waited for.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from raydp.wire.codec import encode
from raydp.wire.control import BROADCAST_TOPIC, presence_topic
from raydp.wire.endpoints import CoordinatorEndpoints
from raydp.wire.polling import Doorbell, EdgePoller, has_input
from raydp.wire.transport import pick_address, send_two

logger = logging.getLogger("raydp.engine.core")


class EngineSockets:
    """The sockets of one running rank (created by the actor, owned by the loop)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        inputs: Sequence[zmq.Socket[bytes]],
        collect: zmq.Socket[bytes],
        broadcast: zmq.Socket[bytes],
        rank: int,
        coordinator_at: tuple[str, str] = ("", ""),
    ) -> None:
        self.ctx, self.inputs, self.collect, self.broadcast = ctx, tuple(inputs), collect, broadcast
        self._coordinator_at = coordinator_at  # where collect and broadcast are connected
        self.coordinator: CoordinatorEndpoints | None = None  # known once the coordinator moved
        self._moving: tuple[CoordinatorEndpoints, str] | None = None
        broadcast.setsockopt(zmq.SUBSCRIBE, BROADCAST_TOPIC)
        broadcast.setsockopt(zmq.SUBSCRIBE, presence_topic(rank))
        self.bell = Doorbell()
        self._order = (broadcast, *self.inputs)  # a Shutdown is read before the inputs
        self._poller = EdgePoller(self._order, [self.bell])
        # Sent on, left with input over a budget, or never read: their FDs may not signal what
        # waits (an edge-triggered FD signals only what arrives after a read found nothing).
        self._recheck: set[zmq.Socket[bytes]] = set(self._order)

    def follow_coordinator(self, endpoints: CoordinatorEndpoints, node_id: str) -> None:
        """From any thread: the coordinator moved to another node; the loop reconnects at its next turn."""
        self._moving = (endpoints, node_id)
        self.ring()

    def apply_move(self) -> bool:
        """On the loop's thread: reconnect to a coordinator that moved, if one did; whether one did."""
        moving, self._moving = self._moving, None
        if moving is None:
            return False
        endpoints, node_id = moving
        same = endpoints.node_id == node_id
        new = (pick_address(endpoints.collect, same_node=same), pick_address(endpoints.broadcast, same_node=same))
        for sock, old, address in zip((self.collect, self.broadcast), self._coordinator_at, new, strict=True):
            if old:
                with contextlib.suppress(zmq.ZMQError):  # its endpoint may never have connected
                    sock.disconnect(old)
            sock.connect(address)
        self._coordinator_at, self.coordinator = new, endpoints
        self._recheck.add(self.broadcast)
        return True

    def ring(self) -> None:
        """Wake the loop from another thread (it then checks why); does nothing once closed."""
        self.bell.ring()

    def wait(self, timeout_ms: int) -> list[zmq.Socket[bytes]]:
        """The sockets that may have input, the broadcast first; blocks up to ``timeout_ms``
        for a signal, unless a socket to recheck has input already."""
        sure = [sock for sock in self._recheck if has_input(sock)]
        self._recheck.clear()
        fired = self._poller.wait(0 if sure else timeout_ms)
        if not sure:
            return fired if len(fired) < 2 else [s for s in self._order if s in fired]
        return [s for s in self._order if s in fired or s in sure]

    def drain(self, sock: zmq.Socket[bytes], budget: int) -> Iterator[list[bytes]]:
        """Up to ``budget`` messages; a socket left with more is rechecked at the next wait,
        since its FD will not signal them again."""
        for _ in range(budget):
            try:
                yield sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
        self._recheck.add(sock)

    def send_to(self, client: bytes, body: bytes) -> None:
        """Queue ``body`` for ``client`` on whichever input it is connected to, without blocking.

        Raises ``zmq.Again`` when its queue is full, and EHOSTUNREACH when no
        input knows it. Asking the ROUTERs in turn (ROUTER_MANDATORY makes an
        unknown peer an immediate error) keeps no per-client state to leak.
        """
        for sock in self.inputs[:-1]:
            self._recheck.add(sock)
            try:
                send_two(sock, client, body)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
        self._recheck.add(self.inputs[-1])
        send_two(self.inputs[-1], client, body)

    def to_coordinator(self, msg: Any) -> bool:
        """Send without blocking (False: dropped); a wedged or dead coordinator is reported elsewhere."""
        try:
            self.collect.send(encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("coordinator queue full, dropped %s", type(msg).__name__)
            return False
        return True

    def close(self) -> None:
        self.bell.close()
        for sock in (*self.inputs, self.collect, self.broadcast):
            sock.close(linger=0)
