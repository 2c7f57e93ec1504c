"""The per-step channel between an engine core and its rank's device workers.

Each worker holds one link to the engine core (the *driver side*):

* a worker on the engine's node connects a Unix stream socket in the rank's
  0700 IPC directory. A round trip costs two syscalls on each side and no
  extra thread, about a third of a ZMQ IPC round trip;
* a worker on another node (``span`` placement) connects a ZMQ DEALER over
  TCP, CURVE-secured like every other cross-node socket.

Frames are length-prefixed (Unix) or single ZMQ messages, carrying msgpack
``Call`` and ``Reply`` structs (no pickle). A control call (``RPC``) is
answered by every worker it went to. A step is answered by the driver worker
(TP rank 0) only; the others write to the channel only if the step failed, so
a step costs the driver one wake-up, not one per worker. The driver looks for
such failure reports while it waits and before every call.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq

from raydp.errors import ProtocolError, RaydpError
from raydp.wire.security import CurveKeys
from raydp.wire.transport import IpcDir, SocketOptions, make_socket, node_ip

STEP, RPC, STOP = 0, 1, 2
_HEADER = struct.Struct("<I")
_HELLO = struct.Struct("<H")
POLL_SLICE_S = 0.05  # how often a blocked receive checks whether a worker was reported dead
SPIN_S = 100e-6  # how long a waiting end of a Unix link polls without sleeping, where it spins at all


def spin_budget_s(world_size: int) -> float:
    """How long a waiting end of a same-node link spins before it sleeps in ``poll``.

    Waking a sleeping process costs tens of microseconds each way (on a VM,
    most of a step's round trip); a peer still spinning from its last step
    answers in a few. Spinning pays while every worker of the rank can have
    a core of its own (the engine spins only while its driver worker works,
    and never for longer than ``SPIN_S``); with fewer cores it is off, as
    spinners would take the cores the others need to answer.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return SPIN_S if cores >= world_size else 0.0


class Call(msgspec.Struct, array_like=True, frozen=True):
    """Driver -> worker: run ``method`` (``STEP``: ``execute_step(payload)``), or ``STOP``."""

    kind: int
    seq: int
    method: str = ""
    args: Any = None
    kwargs: Any = None


class Reply(msgspec.Struct, array_like=True, frozen=True):
    """Worker -> driver: the result of call ``seq``, or the worker's traceback text if not ``ok``."""

    seq: int
    ok: bool
    value: Any = None


call_encoder = msgspec.msgpack.Encoder()
call_decoder = msgspec.msgpack.Decoder(Call)
reply_decoder = msgspec.msgpack.Decoder(Reply)


class LinkClosedError(RaydpError, ConnectionError):
    """The peer closed its end (for a worker: its process ended)."""


class Link(Protocol):
    """One end of a worker's channel."""

    def send(self, frame: bytes) -> None: ...

    def recv(self, deadline: float | None, alive: Callable[[], None]) -> bytes:
        """The next frame; ``alive()`` is called every poll slice and may raise to give up."""
        ...

    def ready(self) -> bool:
        """Whether :meth:`recv` would return at once."""
        ...

    def close(self) -> None: ...


class UnixLink:
    """A length-prefixed frame stream over a connected Unix socket.

    The socket stays blocking (a send always completes, however slow the
    reader); receives first spin for ``spin_s`` (:func:`spin_budget_s`), then
    wait in ``poll`` slices so that a death reported elsewhere ends the wait.
    """

    def __init__(self, sock: socket.socket, max_bytes: int, spin_s: float = 0.0) -> None:
        sock.setblocking(True)
        self.sock, self.max_bytes, self.spin_s = sock, max_bytes, spin_s
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._buf = bytearray()
        self._scratch = bytearray(1 << 16)
        self._view = memoryview(self._scratch)

    def send(self, frame: bytes) -> None:
        header = _HEADER.pack(len(frame))
        try:
            sent = self.sock.sendmsg([header, frame])
            if sent < len(header) + len(frame):  # rare: a signal cut the write short
                self.sock.sendall((header + frame)[sent:])
        except OSError as exc:
            raise LinkClosedError(str(exc)) from None

    def recv(self, deadline: float | None, alive: Callable[[], None]) -> bytes:
        frame = self._take()
        while frame is None:
            n = self._read(deadline, alive)
            if not self._buf and n >= _HEADER.size:
                # The common case: one read holds exactly one frame; skip the buffer.
                (size,) = _HEADER.unpack_from(self._scratch)
                if size + _HEADER.size == n:
                    self._check_size(size)
                    return bytes(self._view[_HEADER.size : n])
            self._buf += self._view[:n]
            frame = self._take()
        return frame

    def ready(self) -> bool:
        """Whether a frame (or the peer's hang-up) is waiting, without blocking."""
        return bool(self._buf) or bool(self._poll.poll(0))

    def _check_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise ProtocolError(f"channel frame of {size} bytes exceeds max_message_bytes={self.max_bytes}")

    def _take(self) -> bytes | None:
        buf = self._buf
        if len(buf) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(buf)
        self._check_size(size)
        end = _HEADER.size + size
        if len(buf) < end:
            return None
        frame = bytes(buf[_HEADER.size : end])
        del buf[:end]
        return frame

    def _read(self, deadline: float | None, alive: Callable[[], None]) -> int:
        """Wait (spinning, then in poll slices calling ``alive``) and read what has arrived into the scratch buffer."""
        if self.spin_s and (n := self._spin()):
            return n
        while True:
            wait = POLL_SLICE_S if deadline is None else min(POLL_SLICE_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError("no reply on the worker channel in time")
            if not self._poll.poll(wait * 1000):
                alive()
                continue
            try:
                n = self.sock.recv_into(self._view)
            except OSError as exc:
                raise LinkClosedError(str(exc)) from None
            if not n:
                raise LinkClosedError("the peer closed the channel")
            return n

    def _spin(self) -> int:
        """Read without sleeping for up to ``spin_s``; 0 if nothing came."""
        end = time.perf_counter() + self.spin_s
        while True:
            try:
                n = self.sock.recv_into(self._view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > end:
                    return 0
                continue
            except OSError as exc:
                raise LinkClosedError(str(exc)) from None
            if not n:
                raise LinkClosedError("the peer closed the channel")
            return n

    def close(self) -> None:
        self.sock.close()


class RouterLink:
    """The driver's end of one remote worker: a peer identity on the shared CURVE ROUTER."""

    def __init__(self, hub: RouterHub, identity: bytes) -> None:
        self.hub, self.identity = hub, identity

    def send(self, frame: bytes) -> None:
        try:
            self.hub.sock.send_multipart([self.identity, frame], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            raise LinkClosedError(str(exc)) from None

    def recv(self, deadline: float | None, alive: Callable[[], None]) -> bytes:
        return self.hub.recv_from(self.identity, deadline, alive)

    def ready(self) -> bool:
        return self.hub.ready(self.identity)

    def close(self) -> None:
        """The hub owns the socket."""


class RouterHub:
    """A ROUTER that remote workers connect to; sorts what arrives by sender."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self._pending: dict[bytes, list[bytes]] = {}

    def ready(self, identity: bytes) -> bool:
        while self.sock.poll(0):
            self._stash(self.sock.recv_multipart())
        return bool(self._pending.get(identity))

    def _stash(self, frames: list[bytes]) -> None:
        if len(frames) == 2:
            self._pending.setdefault(frames[0], []).append(frames[1])

    def recv_from(self, identity: bytes, deadline: float | None, alive: Callable[[], None]) -> bytes:
        while True:
            queued = self._pending.get(identity)
            if queued:
                return queued.pop(0)
            wait = POLL_SLICE_S if deadline is None else min(POLL_SLICE_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError("no reply on the worker channel in time")
            if not self.sock.poll(int(wait * 1000) + 1):
                alive()
                continue
            self._stash(self.sock.recv_multipart())


class DealerLink:
    """The worker's end of a remote channel."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes]) -> None:
        self.ctx, self.sock = ctx, sock

    def send(self, frame: bytes) -> None:
        self.sock.send(frame, copy=False)

    def recv(self, deadline: float | None, alive: Callable[[], None]) -> bytes:
        while not self.sock.poll(int(POLL_SLICE_S * 1000)):
            alive()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no frame on the worker channel in time")
        return self.sock.recv()

    def ready(self) -> bool:
        return bool(self.sock.poll(0))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.destroy(linger=0)


class ChannelServer:
    """The driver's listeners: a Unix socket, plus a CURVE ROUTER when a worker is on another node.

    Workers connect and say hello with their TP rank; :meth:`accept` returns
    one link per TP rank.
    """

    def __init__(
        self, ipc_dir: IpcDir, opts: SocketOptions, *, remote: bool, ctx: zmq.Context[zmq.Socket[bytes]] | None
    ) -> None:
        self.opts = opts
        self._spin_s = 0.0  # set by accept(), which knows the world size
        self.path = str(ipc_dir.path / f"workers-{os.getpid()}.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(128)
        self.addresses = [f"unix://{self.path}"]
        self.hub: RouterHub | None = None
        if remote:
            if ctx is None:
                raise ValueError("a remote worker channel needs the engine's ZMQ context")
            sock = make_socket(ctx, zmq.ROUTER, opts, serves=True)
            port = sock.bind_to_random_port(f"tcp://{node_ip()}")
            self.addresses.append(f"tcp://{node_ip()}:{port}")
            self.hub = RouterHub(sock)

    def accept(self, world_size: int, timeout_s: float, alive: Callable[[], None]) -> list[Link]:
        links: dict[int, Link] = {}
        self._spin_s = spin_budget_s(world_size)
        deadline = time.monotonic() + timeout_s
        self.listener.settimeout(POLL_SLICE_S)
        while len(links) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(links)} of {world_size} workers connected to the channel in time")
            alive()
            self._accept_unix(links)
            self._accept_remote(links)
        return [links[r] for r in range(world_size)]

    def _accept_unix(self, links: dict[int, Link]) -> None:
        try:
            conn, _ = self.listener.accept()
        except TimeoutError:
            return
        conn.settimeout(5.0)
        hello = _recv_exact(conn, _HELLO.size)
        links[_HELLO.unpack(hello)[0]] = UnixLink(conn, self.opts.max_message_bytes, self._spin_s)

    def _accept_remote(self, links: dict[int, Link]) -> None:
        if self.hub is None or not self.hub.sock.poll(0):
            return
        frames = self.hub.sock.recv_multipart()
        if len(frames) == 2 and len(frames[1]) == _HELLO.size:
            links[_HELLO.unpack(frames[1])[0]] = RouterLink(self.hub, frames[0])

    def close_listener(self) -> None:
        """Stop accepting (the remote workers' ROUTER stays: it carries their links)."""
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self.close_listener()
        if self.hub is not None:
            self.hub.sock.close(linger=0)


def connect_worker(
    addresses: list[str], tp_rank: int, same_node: bool, curve: CurveKeys | None, max_bytes: int, world_size: int = 1
) -> Link:
    """The worker's end: the Unix socket on the driver's node, else CURVE TCP."""
    unix = [a for a in addresses if a.startswith("unix://")]
    if same_node and unix:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(unix[0].removeprefix("unix://"))
        sock.sendall(_HELLO.pack(tp_rank))
        # Only the driver worker answers a step, so only it and the engine wait on each
        # other; followers sleep between steps and leave the cores to those two.
        return UnixLink(sock, max_bytes, spin_budget_s(world_size) if tp_rank == 0 else 0.0)
    tcp = [a for a in addresses if a.startswith("tcp://")]
    if not tcp:
        raise ConnectionError(f"no address of {addresses} is reachable from another node")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    opts = SocketOptions(max_message_bytes=max_bytes, curve=curve)
    sock_z = make_socket(ctx, zmq.DEALER, opts, identity=_HELLO.pack(tp_rank))
    sock_z.connect(tcp[0])
    sock_z.send(_HELLO.pack(tp_rank))
    return DealerLink(ctx, sock_z)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise LinkClosedError("the peer closed the channel during hello")
        data += chunk
    return data
