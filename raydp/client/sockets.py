"""The client's ZMQ sockets, used by whichever thread holds the client's lock.

Kept apart from :mod:`raydp.client.client` so that the request bookkeeping reads
without the socket plumbing.

ZMQ sockets are not thread-safe, so the client's threads take turns under one
lock; its IO thread waits for input *outside* that lock, in one ``poll()`` on
the sockets' ``ZMQ_FD``s and the doorbell (:mod:`raydp.wire.polling`). A ``ZMQ_FD`` is edge-triggered:
any operation on a socket may consume its signal. So whoever sends on a
socket checks it for input afterwards (:meth:`ClientSockets.touched`), and a
socket left with input after a turn's budget is read again without waiting.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace
from typing import Any

import zmq

from raydp.wire.codec import encode
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.polling import Doorbell, EdgePoller, has_input
from raydp.wire.protocol import RequestType
from raydp.wire.transport import SocketOptions, input_options, make_socket, pick_address, send_two

logger = logging.getLogger("raydp.client.client")


class ClientSockets:
    """The client's sockets; used only from the IO thread (``ring`` excepted)."""

    def __init__(self, endpoints: ClusterEndpoints, node_id: str | None, opts: SocketOptions) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.identity = b"c" + secrets.token_bytes(7)
        self.node_id, self.opts = node_id, replace(opts, curve=endpoints.curve)
        self._touched: set[zmq.Socket[bytes]] = set()  # sent on, or new: check before waiting on their FDs
        try:
            self._connect(endpoints)
        except BaseException:  # e.g. a bad address: do not leak the context
            self.ctx.destroy(linger=0)
            raise

    def _connect(self, endpoints: ClusterEndpoints) -> None:
        self.engines = [self._engine_socket(ep) for ep in endpoints.engines]
        self._connect_coordinator(endpoints.coordinator)
        self.bell = Doorbell()
        self.reader_bell = Doorbell()  # wakes a caller polling for its own answer (see ClientTurns.read_for)
        self._rebuild_poll_set()

    def describe(self, sock: zmq.Socket[bytes]) -> str:
        """Who sent on ``sock``, as a dropped message names it: its role and the address it connects to."""
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if sock is self.stats:
            return f"coordinator publish {address}"
        rank = next((r for r, s in enumerate(self.engines) if s is sock), "?")
        return f"rank {rank} {address}"

    def _connect_coordinator(self, coord: CoordinatorEndpoints) -> None:
        same = coord.node_id == self.node_id
        self.stats = make_socket(self.ctx, zmq.SUB, self.opts)
        self.stats.setsockopt(zmq.SUBSCRIBE, b"")
        self.stats.connect(pick_address(coord.publish, same_node=same))
        self.collect = make_socket(self.ctx, zmq.PUSH, self.opts)
        self.collect.connect(pick_address(coord.collect, same_node=same))

    def _rebuild_poll_set(self) -> None:
        """Fresh poll sets: the IO thread picks them up at its next turn (it may be polling an old one)."""
        self.poll_set = EdgePoller([*self.engines, self.stats], [self.bell])
        # The IO thread's while nothing is in flight: no engine to read.
        self.quiet_set = EdgePoller([self.stats], [self.bell])
        # What a caller waiting for its own answer polls: the engines only.
        self.reader_set = EdgePoller(self.engines, [self.reader_bell])

    def _engine_socket(self, ep: EngineEndpoint) -> zmq.Socket[bytes]:
        """A DEALER to ``ep``; counted as touched, so it is checked before anyone waits on its FD."""
        address = pick_address(ep.input_addresses, same_node=ep.node_id == self.node_id)
        sock = make_socket(self.ctx, zmq.DEALER, input_options(self.opts, address), identity=self.identity)
        sock.connect(address)
        self._touched.add(sock)  # nothing has read it yet
        return sock

    def reconnect(self, ep: EngineEndpoint) -> None:
        new = self._engine_socket(ep)  # first, so a bad address leaves the old one in place
        old = self.engines[ep.rank]
        self._touched.discard(old)
        old.close(linger=0)
        self.engines[ep.rank] = new
        self._sockets_changed()

    def add_engine(self, ep: EngineEndpoint) -> None:
        """A rank added by a scale-up (ranks are dense: it is the next one)."""
        assert ep.rank == len(self.engines), f"rank {ep.rank} added after {len(self.engines)} ranks"
        self.engines.append(self._engine_socket(ep))
        self._sockets_changed()

    def remove_last_engine(self) -> None:
        """The highest rank went away in a scale-down."""
        sock = self.engines.pop()
        self._touched.discard(sock)
        sock.close(linger=0)
        self._sockets_changed()

    def _sockets_changed(self) -> None:
        self._rebuild_poll_set()
        self.bell.ring()  # the IO thread may be polling a closed socket's FD: make it take the new set

    def touched(self) -> list[zmq.Socket[bytes]]:
        """The sockets sent on since the last call: their FD may have lost a signal, so check them."""
        if not self._touched:
            return []
        socks = list(self._touched)
        self._touched.clear()
        return socks

    def ring(self) -> None:
        """Wake the IO thread."""
        self.bell.ring()

    has_input = staticmethod(has_input)

    @staticmethod
    def recv_nowait(sock: zmq.Socket[bytes]) -> list[bytes] | None:
        """The next message, or None once there is none.

        A non-blocking receive that finds nothing has processed the socket's
        pending commands, so its FD signals the next arrival. (Asking
        ``ZMQ_EVENTS`` first would cost a poll() call and an enum per message.)
        """
        try:
            return sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None

    def send_input(self, rank: int, tag: RequestType, body: bytes) -> bool:
        """Queue a message for ``rank``; False if its queue is full (never blocks)."""
        sock = self.engines[rank]
        self._touched.add(sock)
        try:
            send_two(sock, tag.value, body)
        except zmq.Again:
            return False
        return True

    def move_coordinator(self, coord: CoordinatorEndpoints) -> None:
        """New sockets to a coordinator that moved (the old ones go); the poll sets are rebuilt."""
        self.stats.close(linger=0)
        self.collect.close(linger=0)
        self._connect_coordinator(coord)
        self._rebuild_poll_set()

    def to_coordinator(self, msg: Any) -> None:
        try:
            self.collect.send(encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("client: coordinator queue full, dropped %s", type(msg).__name__)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.bell.close()
        self.reader_bell.close()
