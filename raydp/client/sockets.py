"""The client's ZMQ sockets, owned by its IO thread.

Kept apart from :mod:`raydp.client.client` so that the request bookkeeping reads
without the socket plumbing.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace
from typing import Any

import zmq

from raydp.wire.endpoints import ClusterEndpoints, EngineEndpoint
from raydp.wire.protocol import RequestType, encode
from raydp.wire.transport import SocketOptions, input_options, make_socket, pick_address

logger = logging.getLogger("raydp.client.client")


class ClientSockets:
    """The client's sockets; used only from the IO thread (``ring`` excepted)."""

    def __init__(self, endpoints: ClusterEndpoints, node_id: str | None, opts: SocketOptions) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.identity = b"c" + secrets.token_bytes(7)
        self.node_id, self.opts = node_id, replace(opts, curve=endpoints.curve)
        try:
            self._connect(endpoints)
        except BaseException:  # e.g. a bad address: do not leak the context
            self.ctx.destroy(linger=0)
            raise

    def _connect(self, endpoints: ClusterEndpoints) -> None:
        node_id, opts = self.node_id, self.opts
        self.engines = [self._engine_socket(ep) for ep in endpoints.engines]
        coord = endpoints.coordinator
        same = coord.node_id == node_id
        self.stats = make_socket(self.ctx, zmq.SUB, opts)
        self.stats.setsockopt(zmq.SUBSCRIBE, b"")
        self.stats.connect(pick_address(coord.publish, same_node=same))
        self.collect = make_socket(self.ctx, zmq.PUSH, opts)
        self.collect.connect(pick_address(coord.collect, same_node=same))
        wake_address = f"inproc://raydp-client-wake-{self.identity.hex()}"
        inproc = replace(opts, curve=None)
        self.wake = make_socket(self.ctx, zmq.PAIR, inproc)
        self.wake.bind(wake_address)
        self._bell = make_socket(self.ctx, zmq.PAIR, inproc)
        self._bell.connect(wake_address)
        self.poller = zmq.Poller()
        for sock in (*self.engines, self.stats, self.wake):
            self.poller.register(sock, zmq.POLLIN)

    def _engine_socket(self, ep: EngineEndpoint) -> zmq.Socket[bytes]:
        address = pick_address(ep.input_addresses, same_node=ep.node_id == self.node_id)
        sock = make_socket(self.ctx, zmq.DEALER, input_options(self.opts, address), identity=self.identity)
        sock.connect(address)
        return sock

    def reconnect(self, ep: EngineEndpoint) -> None:
        new = self._engine_socket(ep)  # first, so a bad address leaves the old one in place
        old = self.engines[ep.rank]
        self.poller.unregister(old)
        old.close(linger=0)
        self.engines[ep.rank] = new
        self.poller.register(new, zmq.POLLIN)

    def add_engine(self, ep: EngineEndpoint) -> None:
        """A rank added by a scale-up (ranks are dense: it is the next one)."""
        assert ep.rank == len(self.engines), f"rank {ep.rank} added after {len(self.engines)} ranks"
        sock = self._engine_socket(ep)
        self.engines.append(sock)
        self.poller.register(sock, zmq.POLLIN)

    def remove_last_engine(self) -> None:
        """The highest rank went away in a scale-down."""
        sock = self.engines.pop()
        self.poller.unregister(sock)
        sock.close(linger=0)

    def poll(self, timeout_ms: int) -> list[zmq.Socket[bytes]]:
        return [sock for sock, _ in self.poller.poll(timeout_ms)]

    def ring(self) -> None:
        """Wake the IO thread (callers hold the client's lock)."""
        try:
            self._bell.send(b"", flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # full: the IO thread has rings to read already; closed: nobody to wake

    def drain_wake(self) -> None:
        while self.recv_nowait(self.wake):
            pass

    @staticmethod
    def recv_nowait(sock: zmq.Socket[bytes]) -> list[bytes] | None:
        try:
            return sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None

    def send_input(self, rank: int, tag: RequestType, body: bytes) -> bool:
        """Queue a message for ``rank``; False if its queue is full (never blocks the IO thread)."""
        try:
            self.engines[rank].send_multipart([tag.value, body], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def to_coordinator(self, msg: Any) -> None:
        try:
            self.collect.send(encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("client: coordinator queue full, dropped %s", type(msg).__name__)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
