"""The front-end client: spreads requests over the ranks and demultiplexes outputs.

A :class:`Client` is usable from a driver, a notebook, a Ray Job or an API
server process. Its sockets (:mod:`raydp.client.sockets`):

* one DEALER per engine (connected to the engine's input ROUTER; the engine
  answers on the same socket);
* a SUB on the coordinator's publish socket (load snapshots, wave, running);
* a PUSH to the coordinator's collect socket (``FirstRequest`` when the
  cluster is paused).

Threads take turns on them under one lock: a user thread sends its request
itself (no hand-off to another thread on the way out), and the client's IO
thread waits for input outside the lock, then takes it to read outputs,
snapshots and liveness notices. The tables (requests, calls, dead ranks, the
balancer: :mod:`raydp.client.router`) belong to whoever holds the lock.

The rank for a request is picked at send time
(:class:`~raydp.client.balancer.LoadBalancer`); an explicit ``rank`` pins it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from raydp.client.balancer import LoadBalancer, Policy
from raydp.client.requests import RequestHandle, Submission
from raydp.client.router import RequestRouter
from raydp.client.sockets import ClientSockets
from raydp.errors import (
    ClusterClosedError,
    ConfigError,
    CoordinatorDeadError,
    DeathCause,
    EngineDeadError,
    RaydpError,
)
from raydp.wire.endpoints import ClusterEndpoints, EngineEndpoint
from raydp.wire.protocol import (
    MAX_TOKEN_ID,
    Request,
    StatsSnapshot,
    UtilityCall,
    encode,
)
from raydp.wire.transport import SocketOptions

logger = logging.getLogger("raydp.client.client")
# Up to this many of its requests in flight, a client sends from the caller's thread.
INLINE_MAX_IN_FLIGHT = 4
RECV_BUDGET = 256  # output batches taken from one engine per turn under the lock
IDLE_WAIT_MS = 100  # the IO thread's longest wait: it checks the coordinator's silence, and in-flight work
SILENCE_HEARTBEATS, SILENCE_MIN_S = 5, 5.0  # when a silent coordinator counts as dead
Command = Callable[[], None]


class Client:
    """Send requests to a running cluster; see the module docstring."""

    def __init__(
        self,
        endpoints: ClusterEndpoints,
        *,
        node_id: str | None = None,
        client_index: int = 0,
        client_count: int = 1,
        options: SocketOptions | None = None,
        follow_liveness: bool = True,
        ranks: Collection[int] | None = None,
        balancer: Policy = "least-loaded",
    ) -> None:
        if not 0 <= client_index < client_count:
            raise ConfigError(f"client_index={client_index}: must be in [0, client_count={client_count})")
        self.client_index, self.client_count = client_index, client_count
        self._follow_liveness = follow_liveness
        policy = LoadBalancer(len(endpoints.engines), client_count, ranks, balancer)
        self._call_ids = itertools.count(1)
        # Whoever holds it owns the sockets and every table. Re-entrant: a listener
        # or a future's callback, run under it, may call back into the client.
        self._lock = threading.RLock()
        self._closed = False
        self._fatal: RaydpError = ClusterClosedError("the client is closed")
        self._ids = itertools.count()
        self._silence_limit = max(SILENCE_MIN_S, SILENCE_HEARTBEATS * endpoints.heartbeat_interval_s)
        self._backlogged: set[zmq.Socket[bytes]] = set()  # readable sockets left over a budget
        self._reader: int | None = None  # the caller thread polling for its own answer, if any
        self._io_waiting = False  # the IO thread is (about to be) in poll, on signals a send may take
        self._rung = False  # the IO thread was woken for queued commands since its last turn
        # Whether the IO thread polls the engines' sockets (under _lock). It does not while nothing is
        # in flight: a caller waiting for its answer reads it itself, and an IO thread woken by the
        # same output would only compete with it for the lock and the cores.
        self._io_watching = False
        self._commands: collections.deque[Command | Submission] = collections.deque()  # queued under load
        # Guards the three fields above and the writes of _closed; taken inside _lock, never around it.
        self._queue_lock = threading.Lock()
        self._io = ClientSockets(endpoints, node_id, options or SocketOptions())
        self._router = RequestRouter(
            endpoints, self._io, policy, follow_liveness=follow_liveness, tell_reader=self._tell_reader,
            last_heard=time.monotonic(),
        )
        self._id_prefix = self._io.identity.hex()  # request ids: unique per client, then a counter
        # Read once before anyone waits on its FD: an edge-triggered FD signals only what
        # arrives after a read found nothing (raydp.wire.polling). New engine sockets count
        # as touched (ClientSockets) for the same reason.
        self._backlogged.add(self._io.stats)
        self._thread = threading.Thread(target=self._io_loop, name="raydp-client-io", daemon=True)
        self._thread.start()

    # ---- public API (any thread) --------------------------------------------------

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 16,
        *,
        rank: int | None = None,
        request_id: str | None = None,
        retryable: bool = False,
    ) -> RequestHandle:
        """Send one request; returns at once with a handle to wait on or stream."""
        request = self._make_request(prompt_token_ids, max_tokens, rank, request_id)
        handle = RequestHandle(request.request_id, self._read_for)
        self._locked([Submission(request, rank, handle._on_item, retryable, handle, awaited=True)])
        return handle

    def submit_many(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 16, *, retryable: bool = False
    ) -> list[RequestHandle]:
        """Send many requests at once: one turn of the client's lock and one message per rank.

        Each request still goes to the least-loaded rank at send time (the
        choices spread, as for single submits). Returns one handle per prompt,
        in order; a bad prompt raises ConfigError (naming its index) before
        anything is sent.
        """
        items: list[Submission] = []
        for i, prompt in enumerate(prompts):
            try:
                request = self._make_request(prompt, max_tokens, None, None)
            except ConfigError as exc:
                raise ConfigError(f"prompts[{i}]: {exc}") from None
            handle = RequestHandle(request.request_id, self._read_for)
            items.append(Submission(request, None, handle._on_item, retryable, handle, awaited=True))
        self._submit_batch(items)
        return [item.handle for item in items if item.handle is not None]

    def generate(
        self, prompt_token_ids: Sequence[int], max_tokens: int = 16, *, timeout: float | None = 60.0, **kw: Any
    ) -> list[int]:
        """Send one request and wait for all its tokens."""
        return self.submit(prompt_token_ids, max_tokens, **kw).result(timeout)

    def abort(self, request_id: str) -> None:
        """Abort an in-flight request: its handle finishes with ``finish_reason='abort'``
        and the tokens produced so far; the engine drops it."""
        self._locked(lambda: self._router.abort(request_id))

    def call_utility(self, rank: int, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Call ``method(*args)`` on rank ``rank``'s engine core; msgpack-native args only."""
        self._check_rank(rank, draining_ok=True)
        future: Future[Any] = Future()
        call_id = next(self._call_ids)
        try:  # encode here, so unencodable arguments fail in the caller
            body = encode(UtilityCall(call_id, method, list(args)))
        except TypeError as exc:
            raise ConfigError(f"args={args!r}: not msgpack-encodable ({exc})") from None
        self._locked(lambda: self._router.call(rank, call_id, method, future, body))
        try:
            return future.result(timeout)
        except BaseException:
            # Timed out or interrupted: nobody waits for this answer any more, so
            # the entry goes; a late answer is ignored.
            if not future.done():
                self._locked(lambda: self._router.calls.forget(call_id), allow_closed=True)
            raise

    def snapshot(self) -> StatsSnapshot | None:
        """The latest (counts, wave, running) published by the coordinator."""
        return self._router.last_snapshot

    def mark_dead(self, error: EngineDeadError) -> None:
        """Fail (or retry elsewhere) the requests on a dead rank; stop routing to it."""
        self._locked(lambda: self._router.mark_dead(error), allow_closed=True)

    def revive(self, endpoint: EngineEndpoint) -> None:
        """A restarted rank is back at ``endpoint``: reconnect and route to it again."""
        self._locked(lambda: self._router.revive(endpoint), allow_closed=True)

    def rescale(self, endpoints: ClusterEndpoints, size: int, drain_timeout_s: float | None = None) -> None:
        """Follow a scale change: hold ``endpoints.engines``, send new requests to the first ``size``.

        Ranks at or above ``size`` drain: their requests go on, except retryable
        ones with no output yet, which move to a remaining rank. A rank no
        longer in ``endpoints`` is gone: what is still on it fails with
        :class:`~raydp.errors.ScaleDownError`. Clients in other processes do
        this on their own, from the coordinator's snapshots.
        """
        # Back in the caller, the change is in effect: a request sent next sees the new ranks.
        self._locked(lambda: self._router.rescale(list(endpoints.engines), size, drain_timeout_s), True, now=True)

    @property
    def endpoints(self) -> ClusterEndpoints:
        """Where the cluster's sockets are, as this client last learned (restarts and scale changes move them)."""
        return self._router.endpoints

    @property
    def dp_size(self) -> int:
        """How many ranks this client sends new requests to."""
        return self._router.balancer.size

    def close(self) -> None:
        """Fail what is in flight with ClusterClosedError, stop the IO thread, close sockets."""
        with self._lock, self._queue_lock:
            self._closed = True
        self._io.ring()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # never close sockets under a live IO thread
            logger.error("client IO thread did not stop; leaving its sockets open")
            return
        self._io.close()  # idempotent, and also right after an IO-thread crash

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- validation -------------------------------------------------------------------

    def _make_request(
        self, prompt: Sequence[int], max_tokens: int, rank: int | None, request_id: str | None
    ) -> Request:
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKEN_ID:
            raise ConfigError(f"max_tokens={max_tokens!r}: must be an int in [1, {MAX_TOKEN_ID}]")
        tokens = list(prompt)
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
                raise ConfigError(f"prompt_token_ids[{i}]={t!r}: must be an int in [0, {MAX_TOKEN_ID}]")
        if rank is not None:
            self._check_rank(rank)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ConfigError(f"request_id={request_id!r}: must be a non-empty str")
        rid = request_id or f"{self._id_prefix}-{next(self._ids)}"
        return Request(rid, tokens, max_tokens, arrival_time=time.time())

    def _check_rank(self, rank: int, draining_ok: bool = False) -> None:
        n = len(self.endpoints.engines) if draining_ok else self._router.balancer.size
        if not isinstance(rank, int) or not 0 <= rank < n:
            raise ConfigError(f"rank={rank!r}: must be an int in [0, {n})")

    def _submit_batch(self, items: list[Submission]) -> None:
        """Many submissions under one turn of the lock, one message per rank."""
        if items:
            self._locked(items)

    def _locked(self, command: Command | list[Submission], allow_closed: bool = False, now: bool = False) -> None:
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
            if not now and (self._commands or len(self._router.requests) >= INLINE_MAX_IN_FLIGHT):
                if isinstance(command, list):
                    self._commands.extend(command)
                else:
                    self._commands.append(command)
                if self._io_waiting and not self._rung:  # wake it once per turn
                    self._rung = True
                    self._io.ring()
                return
        with self._lock:
            if self._refused(allow_closed):
                return
            ran_queued = False
            try:
                ran_queued = self._run_queued()  # anything queued goes first, in order
                if isinstance(command, list):
                    self._router.submit_many(command)
                else:
                    command()
            finally:
                if self._io_waiting:  # otherwise the IO thread reads them before it waits again
                    self._read_touched()
                if ran_queued or not (isinstance(command, list) and all(s.awaited for s in command)):
                    self._watch_engines()  # no caller will read what this is answered with
                self._tell_reader()

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
        for sock in self._io.touched():
            if not sock.closed and self._io.has_input(sock) and not self._read_engine(sock):
                self._backlogged.add(sock)  # over the budget: the IO thread goes on
                self._io.ring()

    def _read_for(self, timeout_s: float, answered: Callable[[], bool]) -> bool:
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
        with self._lock:
            if self._closed:
                return False
            # Under load the IO thread reads: a caller that woke for every output and sent
            # one request back each time would lock the client into one-message steps.
            busy = len(self._router.requests) > INLINE_MAX_IN_FLIGHT
            if busy or self._reader is not None or not self._io_waiting or self._commands:
                self._watch_engines()  # the caller waits to be told: somebody must read
                return False
            if answered():  # delivered since the caller last looked: nothing to wait for
                return True
            self._reader = threading.get_ident()
            reader_set = self._io.reader_set
        ready: list[zmq.Socket[bytes]] = []
        try:
            ready = reader_set.wait(max(1, min(int(timeout_s * 1000), 100)))
        finally:
            with self._lock:
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
            self._io.ring()

    def _in_flight(self) -> bool:
        return bool(self._router.requests) or len(self._router.calls) > 0

    # ---- IO thread --------------------------------------------------------------------

    def _io_loop(self) -> None:
        reason: RaydpError = ClusterClosedError("the client was closed")
        ready: list[zmq.Socket[bytes]] = []
        try:
            while True:
                with self._lock:
                    with self._queue_lock:
                        self._io_waiting = self._rung = False
                    if self._closed:
                        break
                    if self._coordinator_silent():
                        reason = self._fatal
                        break
                    self._run_queued()  # commands first: a flood of outputs never delays an abort
                    self._read_ready(ready)
                    self._read_touched()
                    watching = self._in_flight()
                    if watching and not self._io_watching:
                        # Not polled meanwhile: read each engine once, in case an operation
                        # on a socket took the FD's signal of input nobody read.
                        self._backlogged.update(self._io.engines)
                    self._io_watching = watching
                    with self._queue_lock:  # a command queued after this rings the doorbell
                        busy = self._backlogged or self._commands
                        self._io_waiting = True
                    poll_set = self._io.poll_set if watching else self._io.quiet_set
                    timeout_ms = 0 if busy else IDLE_WAIT_MS
                ready = poll_set.wait(timeout_ms)  # without the lock: senders go on
        except Exception as exc:
            logger.exception("client IO thread crashed")
            reason = ClusterClosedError(f"the client's IO thread crashed: {exc!r}")
        finally:
            with self._lock:
                with self._queue_lock:
                    self._closed = True  # later calls raise instead of waiting for nobody
                    self._fatal = reason
                self._run_queued()
                self._router.fail_everything(reason)

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
                self._guarded(self._router.submit_many, batch)
                batch = []
                self._guarded(item)
        self._guarded(self._router.submit_many, batch)
        self._tell_reader()
        return True

    @staticmethod
    def _guarded(command: Callable[..., None], *args: Any) -> None:
        try:
            command(*args)
        except Exception:
            logger.exception("client command failed")

    def _coordinator_silent(self) -> bool:
        """A client that hears of deaths only from the coordinator cannot trust a silent one."""
        if not self._follow_liveness or time.monotonic() - self._router.last_heard < self._silence_limit:
            return False
        self._fatal = CoordinatorDeadError(
            f"of cluster {self.endpoints.name!r}", self.endpoints.coordinator.node_id, DeathCause.UNKNOWN,
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
            if sock is self._io.stats:
                while frames := self._io.recv_nowait(sock):
                    self._router.on_snapshot(frames)
            elif not self._read_engine(sock):
                self._backlogged.add(sock)

    def _read_engine(self, sock: zmq.Socket[bytes]) -> bool:
        """Outputs from one engine, at most a budget (one flooding rank must not starve the
        others, nor the senders waiting for the lock); False if some are left."""
        for _ in range(RECV_BUDGET):
            frames = self._io.recv_nowait(sock)
            if frames is None:
                return True
            self._router.on_output_batch(frames, sock)
            self._tell_reader()
        return False

    def _tell_reader(self) -> None:
        """Something may have reached the caller polling for its answer, behind its back: wake it."""
        if self._reader is not None and self._reader != threading.get_ident():
            self._io.reader_bell.ring()
