"""How a client's threads take turns on its sockets: the callers, and the client's IO thread.

ZMQ sockets are not thread-safe, so a :class:`~raydp.client.client.Client`'s
threads take turns on them under one lock (:class:`ClientTurns`); whoever
holds it owns the sockets and every table (:mod:`raydp.client.router`).

* A caller sends its request itself while the client is quiet (fewer than
  :data:`INLINE_MAX_IN_FLIGHT` of its requests in flight): no hand-off to
  another thread on the way out. Under load its submissions queue, and the IO
  thread sends each burst as one message per rank.
* The IO thread waits for input outside the lock, in one ``poll()`` of the
  sockets' edge-triggered ``ZMQ_FD``s and a doorbell
  (:mod:`raydp.wire.polling`), then takes the lock to read outputs,
  snapshots and liveness notices. While nothing is in flight it polls only
  the coordinator's snapshots and its doorbell.
* A caller waiting for its answer while the IO thread sits in ``poll`` reads
  the engines' sockets itself (:meth:`ClientTurns.read_for`): the answer
  skips the hand-off back. Whoever leaves work in flight that no waiting
  caller will read rings the IO thread, which then watches the engines again.
* A ``ZMQ_FD`` may lose its signal to any operation on its socket, so whoever
  sends on a socket checks it for input afterwards, and a socket left with
  input over a turn's budget is read again without waiting.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from raydp.client.requests import Submission
from raydp.client.router import RequestRouter
from raydp.client.sockets import ClientSockets
from raydp.errors import ClusterClosedError, CoordinatorDeadError, DeathCause, RaydpError
from raydp.wire.codec import encode
from raydp.wire.endpoints import CoordinatorEndpoints
from raydp.wire.protocol import COORDINATOR_UTILITY, UtilityCall

logger = logging.getLogger("raydp.client.client")
# Up to this many of its requests in flight, a client sends from the caller's thread.
INLINE_MAX_IN_FLIGHT = 4
RECV_BUDGET = 256  # output batches taken from one engine per turn under the lock
IDLE_WAIT_MS = 100  # the IO thread's longest wait: it checks the coordinator's silence, and in-flight work
# When a silent coordinator counts as dead: long enough for one whose node died to start on
# another node and be found there (PROBE_HEARTBEATS), short enough to fail what waits on it.
SILENCE_HEARTBEATS, SILENCE_MIN_S = 8, 8.0
PROBE_HEARTBEATS = 1.5  # when a client that follows the coordinator asks an engine whether it moved
_probe_ids = itertools.count(1 << 60)  # apart from the client's own utility call ids
Command = Callable[[], None]


class ClientTurns:
    """The lock, the command queue and the IO thread of one client; see the module docstring.

    Built after the client's sockets and router, and starts the IO thread.
    Once it is closed (or its IO thread ends: a crash, or a coordinator silent
    for :data:`SILENCE_HEARTBEATS` heartbeats when the client follows liveness
    through it), every command raises why, and everything in flight fails with it.
    """

    def __init__(
        self, io: ClientSockets, router: RequestRouter, *, follow_liveness: bool, heartbeat_interval_s: float
    ) -> None:
        self.io, self.router = io, router
        router.tell_reader = self.tell_reader
        self._follow_liveness = follow_liveness
        self._silence_limit = max(SILENCE_MIN_S, SILENCE_HEARTBEATS * heartbeat_interval_s)
        self._heartbeat_s = heartbeat_interval_s
        self._last_probe = 0.0
        # Whoever holds it owns the sockets and every table. Re-entrant: a listener
        # or a future's callback, run under it, may call back into the client.
        self.lock = threading.RLock()
        self._closed = False
        self._fatal: RaydpError = ClusterClosedError("the client is closed")
        # Read once before anyone waits on its FD: an edge-triggered FD signals only what
        # arrives after a read found nothing (raydp.wire.polling). New engine sockets count
        # as touched (ClientSockets) for the same reason.
        self._backlogged: set[zmq.Socket[bytes]] = {io.stats}  # and readable sockets left over a budget
        self._reader: int | None = None  # the caller thread polling for its own answer, if any
        self._io_waiting = False  # the IO thread is (about to be) in poll, on signals a send may take
        self._rung = False  # the IO thread was woken for queued commands since its last turn
        # Whether the IO thread polls the engines' sockets (under lock). It does not while nothing is
        # in flight: a caller waiting for its answer reads it itself, and an IO thread woken by the
        # same output would only compete with it for the lock and the cores.
        self._io_watching = False
        self._commands: collections.deque[Command | Submission] = collections.deque()  # queued under load
        # Guards the three fields above and the writes of _closed; taken inside lock, never around it.
        self._queue_lock = threading.Lock()
        self.thread = threading.Thread(target=self._io_loop, name="raydp-client-io", daemon=True)
        self.thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the IO thread (it fails what is in flight with ClusterClosedError), close the sockets."""
        with self.lock, self._queue_lock:
            self._closed = True
        self.io.ring()
        self.thread.join(timeout=5)
        if self.thread.is_alive():  # never close sockets under a live IO thread
            logger.error("client IO thread did not stop; leaving its sockets open")
            return
        self.io.close()  # idempotent, and also right after an IO-thread crash

    def run(self, command: Command | list[Submission], allow_closed: bool = False, now: bool = False) -> None:
        """Run ``command`` (or send the submissions) holding the sockets: in this thread when the
        client is quiet (or ``now``), else queued for the IO thread, which runs a burst at once.

        Sending inline saves a request two thread hand-offs, which is what
        latency one at a time is made of; under load, the IO thread sends the
        submissions queued meanwhile as one message per rank, which is what
        throughput is made of.
        """
        with self._queue_lock:  # not the sockets' lock: a caller may queue while the IO thread works
            if self._refused(allow_closed):
                return
            if not now and (self._commands or len(self.router.requests) >= INLINE_MAX_IN_FLIGHT):
                if isinstance(command, list):
                    self._commands.extend(command)
                else:
                    self._commands.append(command)
                if self._io_waiting and not self._rung:  # wake it once per turn
                    self._rung = True
                    self.io.ring()
                return
        with self.lock:
            if self._refused(allow_closed):
                return
            ran_queued = False
            try:
                ran_queued = self._run_queued()  # anything queued goes first, in order
                if isinstance(command, list):
                    self.router.submit_many(command)
                else:
                    command()
            finally:
                if self._io_waiting:  # otherwise the IO thread reads them before it waits again
                    self._read_touched()
                if ran_queued or not (isinstance(command, list) and all(s.awaited for s in command)):
                    self._watch_engines()  # no caller will read what this is answered with
                self.tell_reader()

    def _refused(self, allow_closed: bool) -> bool:
        """A closed client takes no command: it raises why, or ignores a notice (``allow_closed``)."""
        if not self._closed:
            return False
        if allow_closed:
            return True  # a notice for a closed client has nobody to tell
        raise self._fatal

    def _read_touched(self) -> None:
        """A send may have taken the signal of input waiting on its socket, which the IO
        thread may be polling for: read that input here."""
        for sock in self.io.touched():
            if not sock.closed and self.io.has_input(sock) and not self._read_engine(sock):
                self._backlogged.add(sock)  # over the budget: the IO thread goes on
                self.io.ring()

    def read_for(self, timeout_s: float, answered: Callable[[], bool]) -> bool:
        """A caller waiting for its answer reads the engines' sockets itself, if nobody else is busy
        with them; False if it cannot (it then waits to be told).

        One at a time, only while few requests are in flight (as for sending
        inline), and only while the IO thread sits in poll: the answer
        then skips the hand-off from the IO thread to the caller, and the
        IO thread's turn (which would hold the lock the caller's next send
        needs). The IO thread still wakes on the same input; whichever thread
        takes the lock first reads it, and if that is the IO thread, it rings
        the reader's bell. ``answered`` is checked once the caller is the
        reader, under the lock every delivery holds: an answer delivered after
        the caller last looked, but before it became the reader, would
        otherwise leave it polling for nothing.
        """
        with self.lock:
            if self._closed:
                return False
            # Under load the IO thread reads: a caller that woke for every output and sent
            # one request back each time would lock the client into one-message steps.
            busy = len(self.router.requests) > INLINE_MAX_IN_FLIGHT
            if busy or self._reader is not None or not self._io_waiting or self._commands:
                self._watch_engines()  # the caller waits to be told: somebody must read
                return False
            if answered():  # delivered since the caller last looked: nothing to wait for
                return True
            self._reader = threading.get_ident()
            reader_set = self.io.reader_set
        ready: list[zmq.Socket[bytes]] = []
        try:
            ready = reader_set.wait(max(1, min(int(timeout_s * 1000), 100)))
        finally:
            with self.lock:
                self._reader = None
                if not self._closed:
                    self._read_ready(ready)
                    self._read_touched()
                    self._watch_engines()  # what is still in flight may have no reader now
        return True

    def _watch_engines(self) -> None:
        """Under the lock: if something is in flight that no caller may be reading for, or input
        was left over a budget, make sure the IO thread reads the engines (ring it out of its
        quiet poll). Ringing it for every request would cost a sequential one a thread wake-up."""
        if (not self._io_watching and self._in_flight()) or self._backlogged:
            self._io_watching = True  # from its next turn on; so it is rung once
            self.io.ring()

    def _in_flight(self) -> bool:
        return bool(self.router.requests) or len(self.router.calls) > 0

    # ---- the IO thread ----------------------------------------------------------------

    def _io_loop(self) -> None:
        reason: RaydpError = ClusterClosedError("the client was closed")
        ready: list[zmq.Socket[bytes]] = []
        try:
            while True:
                with self.lock:
                    with self._queue_lock:
                        self._io_waiting = self._rung = False
                    if self._closed:
                        break
                    self._probe_coordinator()
                    if self._coordinator_silent():
                        reason = self._fatal
                        break
                    self._run_queued()  # commands first: a flood of outputs never delays an abort
                    self._read_ready(ready)
                    self._read_touched()
                    if self.router.kv_waits:
                        self.router.expire_kv(time.monotonic())
                    watching = self._in_flight()
                    if watching and not self._io_watching:
                        # Not polled meanwhile: read each engine once, in case an operation
                        # on a socket took the FD's signal of input nobody read.
                        self._backlogged.update(self.io.engines)
                    self._io_watching = watching
                    with self._queue_lock:  # a command queued after this rings the doorbell
                        busy = self._backlogged or self._commands
                        self._io_waiting = True
                    poll_set = self.io.poll_set if watching else self.io.quiet_set
                    timeout_ms = 0 if busy else IDLE_WAIT_MS
                ready = poll_set.wait(timeout_ms)  # without the lock: senders go on
        except Exception as exc:
            logger.exception("client IO thread crashed")
            reason = ClusterClosedError(f"the client's IO thread crashed: {exc!r}")
        finally:
            with self.lock:
                with self._queue_lock:
                    self._closed = True  # later calls raise instead of waiting for nobody
                    self._fatal = reason
                self._run_queued()
                self.router.fail_everything(reason)

    def _run_queued(self) -> bool:
        """Run what was queued, in order; submissions queued one after another go together, one
        message per rank. One bad command must not take the IO thread down. False if none was."""
        if not self._commands:  # the usual case: nothing to swap
            return False
        with self._queue_lock:
            queued, self._commands = self._commands, collections.deque()
        batch: list[Submission] = []
        for item in queued:
            if isinstance(item, Submission):
                batch.append(item)
            else:
                self._guarded(self.router.submit_many, batch)
                batch = []
                self._guarded(item)
        self._guarded(self.router.submit_many, batch)
        self.tell_reader()
        return True

    @staticmethod
    def _guarded(command: Callable[..., None], *args: Any) -> None:
        try:
            command(*args)
        except Exception:
            logger.exception("client command failed")

    def follow_coordinator(self, coord: CoordinatorEndpoints) -> None:
        """Under the lock: reconnect to a coordinator that moved; its new stats socket is read at once."""
        if self.router.move_coordinator(coord):
            self._backlogged.add(self.io.stats)

    def _probe_coordinator(self) -> None:
        """Silent for a while: ask every engine not known dead (once a heartbeat) whether the coordinator moved.

        The ranks beside it may have died with it, unannounced. An answer comes back on the
        engine's socket, as any utility call's, and the first that names a new place is followed."""
        now = time.monotonic()
        if not self._follow_liveness or now - self.router.feed.last_heard < PROBE_HEARTBEATS * self._heartbeat_s:
            return
        if now - self._last_probe < self._heartbeat_s:
            return
        self._last_probe = now
        for ep in self.router.endpoints.engines:
            if ep.rank in self.router.dead:
                continue
            call_id = next(_probe_ids)
            future: Future[Any] = Future()
            future.add_done_callback(self._on_probe_answer)
            body = encode(UtilityCall(call_id, COORDINATOR_UTILITY, []))
            self.router.call(ep.rank, call_id, COORDINATOR_UTILITY, future, body)

    def _on_probe_answer(self, future: Future[Any]) -> None:
        """On the IO thread (the answer is read there): follow the coordinator if the engine knows it moved."""
        if future.exception() is not None or future.result() is None:
            return
        try:
            coord = msgspec.convert(future.result(), CoordinatorEndpoints)
        except msgspec.ValidationError:
            logger.warning("client: an engine named the coordinator in a shape not understood: %r", future.result())
            return
        with self.lock:
            self.follow_coordinator(coord)

    def _coordinator_silent(self) -> bool:
        """A client that hears of deaths only from the coordinator cannot trust a silent one."""
        if not self._follow_liveness or time.monotonic() - self.router.feed.last_heard < self._silence_limit:
            return False
        self._fatal = CoordinatorDeadError(
            f"of cluster {self.router.endpoints.name!r}",
            self.router.endpoints.coordinator.node_id,
            DeathCause.UNKNOWN,
            f"no snapshot for {self._silence_limit:.0f}s",
        )
        logger.error("client: %s", self._fatal)
        return True

    def _read_ready(self, ready: list[zmq.Socket[bytes]]) -> None:
        """Read the sockets whose FD fired and those left over the budget last turn."""
        socks: Collection[zmq.Socket[bytes]] = ready
        if self._backlogged:
            socks, self._backlogged = set(ready) | self._backlogged, set()
        for sock in socks:
            if sock.closed:  # reconnected or removed meanwhile
                continue
            if sock is self.io.stats:
                while frames := self.io.recv_nowait(sock):
                    self.router.on_snapshot(frames)
            elif not self._read_engine(sock):
                self._backlogged.add(sock)

    def _read_engine(self, sock: zmq.Socket[bytes]) -> bool:
        """Outputs from one engine, at most a budget (one flooding rank must not starve the
        others, nor the senders waiting for the lock); False if some are left."""
        for _ in range(RECV_BUDGET):
            frames = self.io.recv_nowait(sock)
            if frames is None:
                return True
            self.router.on_output_batch(frames, sock)
            self.tell_reader()
        return False

    def tell_reader(self) -> None:
        """Something may have reached the caller polling for its answer, behind its back: wake it."""
        if self._reader is not None and self._reader != threading.get_ident():
            self.io.reader_bell.ring()
