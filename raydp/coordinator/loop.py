"""The coordinator's socket loop around :class:`~raydp.coordinator.state.CoordinatorState`.

Sockets (all bound by the coordinator):

* ``publish`` PUB -> clients' SUB: a :class:`~raydp.wire.control.StatsSnapshot`
  at most every stats interval when something changed, a heartbeat otherwise;
* ``collect`` PULL <- engines' and clients' PUSH: ``EngineStats``,
  ``WaveComplete``, ``StartWave``, ``FirstRequest``, ``HoldAck``, ``EngineReport``,
  ``Regrouped``; and from the launcher ``EngineDead``, ``EngineRevived``,
  ``ScaleEngines``, ``HoldCluster``, ``RegroupCluster``, ``ReleaseCluster``;
* ``broadcast`` XPUB -> engines' SUB: ``[topic, StartDPWave | Hold | Regroup | Release | Resync | Shutdown]``,
  and ``SendCache`` on one rank's presence topic.
  Verbose, so every engine's subscription to its presence topic is seen and
  :meth:`CoordinatorLoop.wait_for_engines` knows who is listening.

Malformed input is logged and dropped; nothing a peer sends can stop the loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time

import msgspec
import zmq

from raydp.config import TransportKind
from raydp.coordinator.silence import Silence
from raydp.coordinator.state import CoordinatorState
from raydp.errors import ProtocolError
from raydp.wire.codec import encode
from raydp.wire.control import (
    BROADCAST_TOPIC,
    AdapterReport,
    CacheReport,
    EngineDead,
    EngineReport,
    EngineRevived,
    EngineStats,
    HoldAck,
    Regrouped,
    Release,
    ScaleEngines,
    SendCache,
    Shutdown,
    StartDPWave,
    StartWave,
    ToCoordinator,
    ToEngines,
    WaveComplete,
    coordinator_decoder,
    presence_topic,
)
from raydp.wire.dropped import DropLog, frame_sender
from raydp.wire.endpoints import CoordinatorEndpoints
from raydp.wire.polling import has_input
from raydp.wire.records import CoordinatorStatus
from raydp.wire.security import guard
from raydp.wire.transport import IpcDir, SocketOptions, bind_endpoints, make_socket

logger = logging.getLogger("raydp.coordinator")
_PRESENCE = presence_topic(0)[:-2]
# How long the loop lets engine messages pile up between batches while they keep coming (see _follow_collect).
# 64 ranks at 100 Hz: 1 ms naps cost ~11% of a core in the loop's thread, 4 ms ~8% (ZeroMQ's IO thread
# takes another ~9% either way); a message of a flood waits up to the nap, against snapshots 100 ms apart.
_NAP_S = 0.004
# The most messages one batch takes: a flood must not hold back snapshots, subscriptions and the stop flag.
_BATCH = 256
# What only a rank sends: each is a word from that rank (raydp.coordinator.silence).
_FROM_RANKS = (EngineStats, WaveComplete, StartWave, HoldAck, Regrouped, EngineReport, CacheReport, AdapterReport)


def _ipc_dir(rebind: CoordinatorEndpoints | None, transport: TransportKind, prefix: str) -> IpcDir | None:
    if rebind is None:
        return IpcDir(prefix) if transport != "tcp" else None
    ipc = [a for a in (*rebind.publish, *rebind.collect, *rebind.broadcast) if a.startswith("ipc://")]
    return IpcDir.reuse(ipc[0]) if ipc else None


class CoordinatorLoop:
    """Binds the three sockets at construction; :meth:`run` serves until :meth:`stop`."""

    def __init__(
        self,
        state: CoordinatorState,
        opts: SocketOptions,
        *,
        transport: TransportKind,
        node_id: str,
        ip: str | None = None,
        ipc_prefix: str = "coordinator",
        rebind: CoordinatorEndpoints | None = None,
    ) -> None:
        """Bind new addresses, or with ``rebind`` exactly those of a dead predecessor on this node."""
        self.state = state
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ipc_dir = _ipc_dir(rebind, transport, ipc_prefix)
        self._gate = None
        try:
            self._gate = guard(self.ctx, opts.curve)
            self.endpoints = self._bind(opts, transport, node_id, ip, rebind)
        except BaseException:  # a failed bind must not leak the context or the directory
            self._stop_gate()
            self.ctx.destroy(linger=0)
            if self.ipc_dir is not None:
                self.ipc_dir.remove()
            raise
        self.subscribed: set[int] = set()
        self._subscribed_changed = threading.Condition()
        self._stop = threading.Event()
        # Only the thread in run() touches the sockets; describe() comes from
        # other threads (Ray's, the mp control pipe's) and reads under this lock.
        self._state_lock = threading.Lock()
        self._lifecycle = threading.Lock()
        self._started = False
        self._closed = False
        self._finished = threading.Event()
        self.dropped = 0
        self._drops = DropLog(logger, "coordinator")
        self.broadcasts = 0
        self.silence = Silence(state.engine_count)  # read and written under the state lock

    def _bind(
        self,
        opts: SocketOptions,
        transport: TransportKind,
        node_id: str,
        ip: str | None,
        rebind: CoordinatorEndpoints | None,
    ) -> CoordinatorEndpoints:
        self.publish = make_socket(self.ctx, zmq.PUB, opts, serves=True)
        self.collect = make_socket(self.ctx, zmq.PULL, opts, serves=True)
        self.broadcast = make_socket(self.ctx, zmq.XPUB, opts, serves=True)
        self.broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)

        def bind(sock: zmq.Socket[bytes], name: str) -> list[str]:
            if rebind is not None:
                addresses: list[str] = getattr(rebind, name)
                for address in addresses:
                    sock.bind(address)
                return list(addresses)
            return bind_endpoints(sock, name, transport=transport, ipc_dir=self.ipc_dir, ip=ip)

        return CoordinatorEndpoints(
            node_id=node_id,
            publish=bind(self.publish, "publish"),
            collect=bind(self.collect, "collect"),
            broadcast=bind(self.broadcast, "broadcast"),
        )

    def run(self) -> None:
        """Serve until :meth:`stop`, then tell engines to leave and close every socket.

        The teardown happens here, in the thread that used the sockets, so no
        other thread ever closes a socket under a running poll.
        """
        with self._lifecycle:
            if self._closed:
                return
            self._started = True
        try:
            self._serve()
        finally:
            self._teardown()
            self._finished.set()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.collect, zmq.POLLIN)
        poller.register(self.broadcast, zmq.POLLIN)
        while not self._stop.is_set():
            # Rounded up: truncating a deadline under 1 ms to poll(0) spins until it passes.
            timeout_ms = math.ceil(min(100.0, 1000 * self.state.next_deadline(time.monotonic())))
            for sock, _ in poller.poll(timeout_ms):
                if sock is self.collect:
                    self._follow_collect()
                else:
                    self._drain_subscriptions()
            self._send_due(time.monotonic())

    def _send_due(self, now: float) -> None:
        """Publish a due snapshot and repeat due broadcasts."""
        with self._state_lock:
            snap = self.state.due_snapshot(now)
            repeats = self.state.due_broadcasts(now)
            asks = self.state.cache.asks(now)
        if snap is not None:
            self.publish.send(encode(snap))
        for msg in repeats:
            self._broadcast(msg)
        for rank in asks:  # an engine whose cache report went missing: to it alone, on its own topic
            self.broadcast.send_multipart([presence_topic(rank), encode(SendCache())])

    def _follow_collect(self) -> None:
        """Take messages in batches while they keep coming, then return to the poller.

        With many engines nearly every message arrives alone, and waking for
        each one (in ``zmq_poll`` or a blocking ``recv``) costs more than
        handling it. So once the socket runs dry the loop naps ``_NAP_S`` and
        takes whatever piled up meanwhile in one go; a nap that brings nothing
        ends the burst. The first message of a burst is handled at once; the
        others wait at most one nap. Snapshots and subscriptions are looked at
        after every batch, and a batch is at most ``_BATCH`` messages (then no
        nap: more are waiting).
        """
        while not self._stop.is_set():
            taken = self._take_batch()
            if not taken:
                return
            if has_input(self.broadcast):
                self._drain_subscriptions()
            self._send_due(time.monotonic())
            if taken < _BATCH:
                time.sleep(_NAP_S)

    def _take_batch(self) -> int:
        """Handle the messages waiting on the collect socket, at most ``_BATCH``; return how many."""
        for count in range(_BATCH):
            try:
                frame = self.collect.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return count
            self._handle(frame)
        return _BATCH

    def _handle(self, frame: zmq.Frame) -> None:
        if frame.more:  # every message here is one frame: a multipart one is dropped whole, once
            self._drop(frame_sender("collect", frame), f"a message of {1 + self._discard_rest()} frames (want 1)")
            return
        try:
            msg = coordinator_decoder(frame.buffer)
        except ProtocolError as exc:
            self._drop(frame_sender("collect", frame), str(exc))
            return
        with self._state_lock:
            out = self.state.handle(msg)
            self._note_word(msg)
            # A release may start the next wave, which must go right behind it.
            repeats = self.state.due_broadcasts(time.monotonic()) if isinstance(out, Release) else []
        if out is not None:
            self._broadcast(out)
        for extra in repeats:  # e.g. the wave a release starts, right behind the Release
            self._broadcast(extra)

    def _note_word(self, msg: ToCoordinator) -> None:
        """Keep the silence clock (callers hold the state lock)."""
        if isinstance(msg, _FROM_RANKS):
            self.silence.hear(msg.rank, time.monotonic())
        elif isinstance(msg, EngineDead | EngineRevived):
            self.silence.forget(msg.rank)
        elif isinstance(msg, ScaleEngines):
            self.silence.resize(self.state.engine_count)

    def _drain_subscriptions(self) -> None:
        while True:
            try:
                frame = self.broadcast.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frame) != len(_PRESENCE) + 3 or frame[1:-2] != _PRESENCE:
                continue  # the broadcast-topic subscription, or noise
            rank = int.from_bytes(frame[-2:], "little")
            if rank >= self.state.engine_count:
                self._drop("broadcast subscriber", f"subscription for unknown rank {rank}")
                continue
            with self._subscribed_changed:
                (self.subscribed.add if frame[0] == 1 else self.subscribed.discard)(rank)
                self._subscribed_changed.notify_all()

    def _broadcast(self, msg: ToEngines) -> None:
        self.broadcasts += 1
        if isinstance(msg, StartDPWave):
            with self._state_lock:
                self.state.note_broadcast(time.monotonic())
        self.broadcast.send_multipart([BROADCAST_TOPIC, encode(msg)])

    def _discard_rest(self) -> int:
        """Read the remaining parts of a multipart message (all there already); return how many."""
        count = 0
        while self.collect.getsockopt(zmq.RCVMORE):
            self.collect.recv(copy=False)
            count += 1
        return count

    def _drop(self, sender: str, why: str) -> None:
        self.dropped += 1
        self._drops.drop(sender, why)

    def describe(self) -> CoordinatorStatus:
        """Wave, running flag, counts and counters, for operators and tests (any thread)."""
        s = self.state
        with self._state_lock, self._subscribed_changed:
            status = s.status(dropped=self.dropped, broadcasts=self.broadcasts, subscribed=self.subscribed)
            return msgspec.structs.replace(status, silent_s=self.silence.seconds(time.monotonic()))

    def wait_for_rank(self, rank: int, timeout_s: float) -> bool:
        """Block until engine ``rank`` has subscribed (a restarted one, whatever its peers do)."""
        with self._subscribed_changed:
            return self._subscribed_changed.wait_for(lambda: rank in self.subscribed, timeout=timeout_s)

    def wait_for_engines(self, ranks: int, timeout_s: float) -> bool:
        """Block until ``ranks`` engines have subscribed to the broadcast socket."""
        with self._subscribed_changed:
            return self._subscribed_changed.wait_for(lambda: len(self.subscribed) >= ranks, timeout=timeout_s)

    def stop(self) -> None:
        self._stop.set()

    def _stop_gate(self) -> None:
        if self._gate is not None:
            self._gate.stop()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop, and wait for :meth:`run` to tear its sockets down (or do it here if it never ran).

        ``run`` sees the stop flag within one poll (at most 100 ms). If it is
        still busy after ``timeout_s`` the sockets are left to process exit
        rather than closed under it.
        """
        self.stop()
        with self._lifecycle:
            self._closed = True
            started = self._started
        if not started:
            self._teardown()
        elif not self._finished.wait(timeout_s):
            logger.error("coordinator loop did not stop within %.1fs; leaving its sockets to exit", timeout_s)

    def _teardown(self) -> None:
        """Tell engines to leave, then close every socket and the IPC directory."""
        with contextlib.suppress(zmq.ZMQError):
            self._broadcast(Shutdown())
        self._stop_gate()
        self.ctx.destroy(linger=100)
        if self.ipc_dir is not None:
            self.ipc_dir.remove()
