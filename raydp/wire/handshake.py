"""The startup handshake between a front-end and its engines (``docs/architecture.md``, "Startup").

The front-end binds a ROUTER (:class:`HandshakeServer`). Each engine connects a
DEALER whose identity is its rank, 2 bytes little endian
(:func:`engine_handshake`), and the exchange is::

    engine -> HELLO{local}
    front  -> INIT{addresses, parallel config}     (or REJECT{reason})
    engine -> READY{capacity, config_hash, input_addresses}

The server rejects, naming the rank, an unknown rank, a duplicate rank, a
message out of order, a local/remote mismatch and a config hash mismatch; it
drops, logging the sender (:mod:`raydp.wire.dropped`), what is not a handshake
message from a 2-byte identity at all. While
it waits it calls ``liveness()`` every poll so a dead engine fails the startup
at once instead of after the timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import zmq

from raydp.config import RaydpConfig, TransportKind
from raydp.errors import HandshakeError, ProtocolError, StartupError
from raydp.wire.codec import encode
from raydp.wire.dropped import DropLog, identity_sender
from raydp.wire.protocol import (
    Hello,
    Init,
    ParallelConfig,
    Ready,
    Reject,
    handshake_decoder,
    identity_rank,
    rank_identity,
)
from raydp.wire.transport import IpcDir, SocketOptions, bind_endpoints, make_socket

logger = logging.getLogger("raydp.wire.handshake")
POLL_MS = 20


@dataclass
class _Slot:
    expected_local: bool
    hello: Hello | None = None
    ready: Ready | None = None


@dataclass
class HandshakeResult:
    ready: dict[int, Ready] = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return sum(r.capacity for r in self.ready.values())


def parallel_config(
    config: RaydpConfig, dp_master: str, dp_size: int | None = None, wave: int = 0, rank: int = -1
) -> ParallelConfig:
    """The parallel layout a rank's INIT carries (``dp_size``: the size after a scale change; ``rank``'s
    own devices, which a P/D cluster's pools may size differently)."""
    return ParallelConfig(
        dp_size or config.dp_size,
        config.world_size_of(rank) if rank >= 0 else config.world_size,
        config.lockstep,
        config.allreduce_interval,
        dp_master,
        config.stats_interval_s,
        wave,
    )


class HandshakeServer:
    """The front-end side: bind, then :meth:`run` until every expected rank is READY."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        opts: SocketOptions,
        *,
        transport: TransportKind,
        ipc_dir: IpcDir | None,
        ip: str | None = None,
    ) -> None:
        self._sock = make_socket(ctx, zmq.ROUTER, opts, serves=True)
        self.addresses = bind_endpoints(self._sock, "handshake", transport=transport, ipc_dir=ipc_dir, ip=ip)
        self.drops = DropLog(logger, "handshake")

    def run(
        self,
        expected_local: dict[int, bool],
        init_for: Callable[[int], Init],
        config_hash: str,
        timeout_s: float,
        liveness: Callable[[], None] = lambda: None,
        progress: Callable[[int, int], None] | None = None,
    ) -> HandshakeResult:
        slots = {rank: _Slot(local) for rank, local in expected_local.items()}
        deadline = time.monotonic() + timeout_s
        done = 0
        while done < len(slots):
            liveness()
            if time.monotonic() > deadline:
                raise StartupError(_timeout_message(slots, timeout_s))
            if not self._sock.poll(POLL_MS):
                continue
            rank = self._on_message(slots, init_for, config_hash)
            if rank is not None:
                done += 1
                if progress is not None:
                    progress(done, len(slots))
        return HandshakeResult({r: s.ready for r, s in slots.items() if s.ready is not None})

    def _on_message(self, slots: dict[int, _Slot], init_for: Callable[[int], Init], config_hash: str) -> int | None:
        """Handle one message; return the rank that just became READY, if any."""
        frames = self._sock.recv_multipart()
        sender = identity_sender("peer", frames[0])  # a ROUTER puts the identity first: it is always there
        if len(frames) != 2:
            self.drops.drop(sender, f"a message of {len(frames) - 1} frames (want 1)")
            return None
        identity, body = frames
        try:
            rank = identity_rank(identity)
            msg = handshake_decoder(body)
        except ProtocolError as exc:
            self.drops.drop(sender, str(exc))
            return None
        slot = slots.get(rank)
        if slot is None:
            self._reject(identity, f"unknown rank {rank}; expected ranks {sorted(slots)}", rank)
        if isinstance(msg, Hello):
            self._on_hello(identity, rank, slot, msg, init_for)
            return None
        if isinstance(msg, Ready):
            self._on_ready(identity, rank, slot, msg, config_hash)
            return rank
        self._reject(identity, f"rank {rank} sent {type(msg).__name__}, which engines never send", rank)

    def _on_hello(self, identity: bytes, rank: int, slot: _Slot, msg: Hello, init_for: Callable[[int], Init]) -> None:
        if slot.hello is not None:
            self._reject(identity, f"duplicate rank {rank}: a second HELLO arrived", rank)
        if msg.local != slot.expected_local:
            where = "local" if msg.local else "remote"
            want = "local" if slot.expected_local else "remote"
            self._reject(identity, f"rank {rank} says it is {where} but was placed {want}", rank)
        slot.hello = msg
        self._sock.send_multipart([identity, encode(init_for(rank))])

    def _on_ready(self, identity: bytes, rank: int, slot: _Slot, msg: Ready, config_hash: str) -> None:
        if slot.hello is None:
            self._reject(identity, f"rank {rank} sent READY before HELLO", rank)
        if slot.ready is not None:
            self._reject(identity, f"duplicate rank {rank}: a second READY arrived", rank)
        if msg.config_hash != config_hash:
            self._reject(
                identity,
                f"rank {rank} config hash {msg.config_hash!r} != front-end's {config_hash!r}",
                rank,
            )
        slot.ready = msg

    def _reject(self, identity: bytes, reason: str, rank: int) -> NoReturn:
        try:
            self._sock.send_multipart([identity, encode(Reject(reason))], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone; the error below is what matters
        raise HandshakeError(f"handshake failed: {reason}", rank=rank)

    def close(self) -> None:
        self._sock.close(linger=0)


def _timeout_message(slots: dict[int, _Slot], timeout_s: float) -> str:
    silent = [r for r, s in slots.items() if s.hello is None]
    unready = [r for r, s in slots.items() if s.hello is not None and s.ready is None]
    return (
        f"engine startup timed out after {timeout_s:.0f}s: no HELLO from ranks {silent}, no READY from ranks {unready}"
    )


def engine_handshake(
    ctx: zmq.Context[zmq.Socket[bytes]],
    opts: SocketOptions,
    address: str,
    rank: int,
    *,
    local: bool,
    make_ready: Callable[[Init], Ready],
    timeout_s: float,
) -> Init:
    """The engine side: HELLO, wait for INIT, answer READY from ``make_ready(init)``."""
    sock = make_socket(ctx, zmq.DEALER, opts, identity=rank_identity(rank))
    try:
        sock.connect(address)
        sock.send(encode(Hello(local=local)))
        if not sock.poll(int(timeout_s * 1000)):
            raise StartupError(f"rank {rank}: no INIT from the front-end at {address} in {timeout_s:.0f}s")
        msg = handshake_decoder(sock.recv())
        if isinstance(msg, Reject):
            raise HandshakeError(f"front-end rejected rank {rank}: {msg.reason}", rank=rank)
        if not isinstance(msg, Init):
            raise HandshakeError(f"rank {rank}: expected INIT, got {type(msg).__name__}", rank=rank)
        sock.send(encode(make_ready(msg)))
        return msg
    finally:
        sock.close(linger=1000)
