"""The client's ZMQ sockets, used by whichever thread holds the client's lock.

Kept apart from :mod:`raydp.client.client` so that the request bookkeeping reads
without the socket plumbing.

ZMQ sockets are not thread-safe, so the client's threads take turns under one
lock; its IO thread waits for input *outside* that lock, in ``select.poll``
on the sockets' ``ZMQ_FD``s and the doorbell. A ``ZMQ_FD`` is edge-triggered:
any operation on a socket may consume its signal. So whoever sends on a
socket checks it for input afterwards (:meth:`ClientSockets.touched`), and a
socket left with input after a turn's budget is read again without waiting.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
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
        self.bell = Doorbell()
        self.reader_bell = Doorbell()  # wakes a caller polling for its own answer (see Client._read_for)
        self._touched: set[zmq.Socket[bytes]] = set()
        self._rebuild_poll_set()

    def _rebuild_poll_set(self) -> None:
        """A fresh poll set: the IO thread picks it up at its next turn (it may be polling the old one)."""
        poll_set = select.poll()
        by_fd: dict[int, zmq.Socket[bytes]] = {}
        for sock in (*self.engines, self.stats):
            fd = int(sock.getsockopt(zmq.FD))
            by_fd[fd] = sock
            poll_set.register(fd, select.POLLIN)
        poll_set.register(self.bell.fileno, select.POLLIN)
        reader_set = select.poll()  # the engines only: what a caller waiting for its answer polls
        for fd, sock in by_fd.items():
            if sock is not self.stats:
                reader_set.register(fd, select.POLLIN)
        reader_set.register(self.reader_bell.fileno, select.POLLIN)
        self.poll_set, self.reader_set, self._by_fd = poll_set, reader_set, by_fd

    def _engine_socket(self, ep: EngineEndpoint) -> zmq.Socket[bytes]:
        address = pick_address(ep.input_addresses, same_node=ep.node_id == self.node_id)
        sock = make_socket(self.ctx, zmq.DEALER, input_options(self.opts, address), identity=self.identity)
        sock.connect(address)
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

    def wait(self, poll_set: select.poll, timeout_ms: int) -> list[zmq.Socket[bytes]]:
        """Block (without the client's lock) until input may be there; the sockets whose FD fired.

        The doorbell is drained here, not returned. A socket may come back with
        no input, or closed meanwhile: the caller checks under the lock.
        """
        ready = []
        for fd, _ in poll_set.poll(timeout_ms):
            if fd == self.bell.fileno:
                self.bell.drain()
            elif fd == self.reader_bell.fileno:
                self.reader_bell.drain()
            elif (sock := self._by_fd.get(fd)) is not None:
                ready.append(sock)
        return ready

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

    @staticmethod
    def has_input(sock: zmq.Socket[bytes]) -> bool:
        """Whether a message waits (processing the socket's commands, so its FD signals the next)."""
        return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

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
            sock.send_multipart([tag.value, body], flags=zmq.NOBLOCK)
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
        self.bell.close()
        self.reader_bell.close()


class Doorbell:
    """A pipe the IO thread polls next to its sockets, so user threads can wake it.

    A pipe rather than an inproc ZMQ pair: a write and a wake-up from ``poll``
    cost a few microseconds, where a ZMQ send and the receiver's mailbox
    round trip cost tens, on every request.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._closed = False

    @property
    def fileno(self) -> int:
        return self._read

    def ring(self) -> None:
        if self._closed:
            return  # nobody to wake
        try:
            os.write(self._write, b"!")
        except BlockingIOError:
            pass  # full: the IO thread has rings to read already

    def drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._read)
            os.close(self._write)
