"""The front-end client: spreads requests over the ranks and demultiplexes outputs.

A :class:`Client` is usable from a driver, a notebook, a Ray Job or an API
server process. It owns one IO thread, which alone touches its ZMQ sockets:

* one DEALER per engine (connected to the engine's input ROUTER; the engine
  answers on the same socket);
* a SUB on the coordinator's publish socket (load snapshots, wave, running);
* a PUSH to the coordinator's collect socket (``FirstRequest`` when the
  cluster is paused);
* an inproc PAIR that user threads ring after queueing a command.

The rank for a request is picked on the IO thread at send time
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

import msgspec
import zmq

from raydp.client.balancer import LoadBalancer, Policy
from raydp.client.calls import PendingCalls
from raydp.client.membership import membership
from raydp.client.requests import Listener, RequestHandle, RequestState, Submission
from raydp.client.sockets import ClientSockets
from raydp.errors import (
    ClusterClosedError,
    ConfigError,
    CoordinatorDeadError,
    DeathCause,
    EngineDeadError,
    ProtocolError,
    RaydpError,
    ScaleDownError,
)
from raydp.wire.dropped import DropLog
from raydp.wire.endpoints import ClusterEndpoints, EngineEndpoint
from raydp.wire.protocol import (
    MAX_TOKEN_ID,
    Abort,
    FirstRequest,
    Output,
    Request,
    RequestBatch,
    RequestType,
    StatsSnapshot,
    UtilityCall,
    encode,
    output_decoder,
    snapshot_decoder,
)
from raydp.wire.transport import SocketOptions

logger = logging.getLogger("raydp.client.client")
RECV_BUDGET = 256  # output batches taken from one engine per IO-thread turn
SILENCE_HEARTBEATS, SILENCE_MIN_S = 5, 5.0  # when a silent coordinator counts as dead
Command = Callable[[], None]
_NONE: frozenset[str] = frozenset()  # a single submit has no batch to clash with


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
        self.endpoints = endpoints
        self.client_index, self.client_count = client_index, client_count
        # Clients in the launching process hear of deaths from the manager directly;
        # every other client (API servers, attached notebooks) from the coordinator.
        self._follow_liveness = follow_liveness
        self._balancer = LoadBalancer(len(endpoints.engines), client_count, ranks, balancer)
        self._requests: dict[str, RequestState] = {}
        self._calls = PendingCalls()
        self._call_ids = itertools.count(1)
        self._dead: dict[int, EngineDeadError] = {}
        self._commands: collections.deque[Command] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self._armed = True
        self._fatal: RaydpError = ClusterClosedError("the client is closed")
        self._ids = itertools.count()
        self._last_snapshot: StatsSnapshot | None = None
        self._last_heard = time.monotonic()
        self._silence_limit = max(SILENCE_MIN_S, SILENCE_HEARTBEATS * endpoints.heartbeat_interval_s)
        self._drops = DropLog(logger, "client")
        self._io = ClientSockets(endpoints, node_id, options or SocketOptions())
        self._id_prefix = self._io.identity.hex()  # request ids: unique per client, then a counter
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
        handle = RequestHandle(request.request_id)
        self._submit(request, rank, handle._on_item, retryable, handle)
        return handle

    def submit_many(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 16, *, retryable: bool = False
    ) -> list[RequestHandle]:
        """Send many requests at once: one hand-off to the IO thread and one message per rank.

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
            handle = RequestHandle(request.request_id)
            items.append(Submission(request, None, handle._on_item, retryable, handle))
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
        self._enqueue(lambda: self._do_abort(request_id))

    def call_utility(self, rank: int, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Call ``method(*args)`` on rank ``rank``'s engine core; msgpack-native args only."""
        self._check_rank(rank, draining_ok=True)
        future: Future[Any] = Future()
        call_id = next(self._call_ids)
        try:  # encode here, so unencodable arguments fail in the caller
            body = encode(UtilityCall(call_id, method, list(args)))
        except TypeError as exc:
            raise ConfigError(f"args={args!r}: not msgpack-encodable ({exc})") from None
        self._enqueue(lambda: self._do_call(rank, call_id, method, future, body))
        try:
            return future.result(timeout)
        except BaseException:
            # Timed out or interrupted: nobody waits for this answer any more, so the
            # IO thread (the table's only user) drops the entry; a late answer is ignored.
            if not future.done():
                self._enqueue(lambda: self._calls.forget(call_id), allow_closed=True)
            raise

    def snapshot(self) -> StatsSnapshot | None:
        """The latest (counts, wave, running) published by the coordinator."""
        return self._last_snapshot

    def mark_dead(self, error: EngineDeadError) -> None:
        """Fail (or retry elsewhere) the requests on a dead rank; stop routing to it."""
        self._enqueue(lambda: self._do_mark_dead(error), allow_closed=True)

    def revive(self, endpoint: EngineEndpoint) -> None:
        """A restarted rank is back at ``endpoint``: reconnect and route to it again."""
        self._enqueue(lambda: self._do_revive(endpoint), allow_closed=True)

    def rescale(self, endpoints: ClusterEndpoints, size: int, drain_timeout_s: float | None = None) -> None:
        """Follow a scale change: hold ``endpoints.engines``, send new requests to the first ``size``.

        Ranks at or above ``size`` drain: their requests go on, except retryable
        ones with no output yet, which move to a remaining rank. A rank no
        longer in ``endpoints`` is gone: what is still on it fails with
        :class:`~raydp.errors.ScaleDownError`. Clients in other processes do
        this on their own, from the coordinator's snapshots.
        """
        applied = threading.Event()

        def command() -> None:
            try:
                self._do_rescale(list(endpoints.engines), size, drain_timeout_s)
            finally:
                applied.set()

        self._enqueue(command, allow_closed=True)
        # Back in the caller, the change is in effect: a request sent next sees the new ranks.
        if not self._closed and not applied.wait(timeout=10):
            logger.warning("client: the IO thread took over 10s to apply a scale change")

    @property
    def dp_size(self) -> int:
        """How many ranks this client sends new requests to."""
        return self._balancer.size

    def close(self) -> None:
        """Fail what is in flight with ClusterClosedError, stop the IO thread, close sockets."""
        with self._lock:
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
        n = len(self.endpoints.engines) if draining_ok else self._balancer.size
        if not isinstance(rank, int) or not 0 <= rank < n:
            raise ConfigError(f"rank={rank!r}: must be an int in [0, {n})")

    def _submit(
        self,
        request: Request,
        rank: int | None,
        listener: Listener,
        retryable: bool,
        handle: RequestHandle | None = None,
    ) -> None:
        def command() -> None:
            self._do_submit(request, rank, listener, retryable, handle)

        self._enqueue(command)

    def _submit_batch(self, items: list[Submission]) -> None:
        """Many submissions in one command (one lock, one wake-up of the IO thread)."""
        if items:
            self._enqueue(lambda: self._do_submit_many(items))

    def _enqueue(self, command: Command, allow_closed: bool = False) -> None:
        with self._lock:
            if self._closed:
                if allow_closed:
                    return  # a notice for a closed client has nobody to tell
                raise self._fatal
            self._commands.append(command)
            if self._armed:  # the IO thread may be asleep in poll: wake it (once)
                self._armed = False
                self._io.ring()

    # ---- IO thread --------------------------------------------------------------------

    def _io_loop(self) -> None:
        reason: RaydpError = ClusterClosedError("the client was closed")
        try:
            while not self._closed:
                if self._coordinator_silent():
                    reason = self._fatal
                    break
                # Commands first, so a flood of outputs never delays an abort or a submit.
                self._armed = False
                self._run_commands()
                # Armed before the last look at the queue: a command queued after
                # that look sees the flag and rings, so none waits out the poll.
                self._armed = True
                for sock in self._io.poll(0 if self._commands else 100):
                    if not sock.closed:  # a reconnect earlier in this batch closed it
                        self._on_readable(sock)
        except Exception as exc:
            logger.exception("client IO thread crashed")
            reason = ClusterClosedError(f"the client's IO thread crashed: {exc!r}")
        finally:
            with self._lock:
                self._closed = True  # later calls raise instead of queueing for nobody
                self._fatal = reason
            self._run_commands()
            self._fail_everything(reason)

    def _coordinator_silent(self) -> bool:
        """A client that hears of deaths only from the coordinator cannot trust a silent one."""
        if not self._follow_liveness or time.monotonic() - self._last_heard < self._silence_limit:
            return False
        self._fatal = CoordinatorDeadError(
            f"of cluster {self.endpoints.name!r}", self.endpoints.coordinator.node_id, DeathCause.UNKNOWN,
            f"no snapshot for {self._silence_limit:.0f}s",
        )
        logger.error("client: %s", self._fatal)
        return True

    def _run_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            try:
                command()
            except Exception:  # one bad command must not take the IO thread down
                logger.exception("client command failed")

    def _on_readable(self, sock: zmq.Socket[bytes]) -> None:
        io = self._io
        if sock is io.wake:
            io.drain_wake()
        elif sock is io.stats:
            while frames := io.recv_nowait(sock):
                self._on_snapshot(frames)
        else:
            # A budget per turn: one flooding rank must not starve the others,
            # nor the commands (submits, aborts) waiting behind it.
            for _ in range(RECV_BUDGET):
                frames = io.recv_nowait(sock)
                if frames is None:
                    break
                self._on_output_batch(frames, sock)

    def _sender(self, sock: zmq.Socket[bytes]) -> str:
        """Who sent on ``sock``, as a dropped message names it: its role and the address it connects to."""
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if sock is self._io.stats:
            return f"coordinator publish {address}"
        rank = next((r for r, s in enumerate(self._io.engines) if s is sock), "?")
        return f"rank {rank} {address}"

    def _on_snapshot(self, frames: list[bytes]) -> None:
        try:
            snap = snapshot_decoder(_one_frame(frames))
        except ProtocolError as exc:
            self._drops.drop(self._sender(self._io.stats), str(exc))
            return
        self._last_snapshot = snap
        self._last_heard = time.monotonic()
        if self._follow_liveness:
            try:
                engines, size = membership(self.endpoints.engines, snap)
                if len(engines) != len(self.endpoints.engines) or size != self._balancer.size:
                    self._do_rescale(engines, size, None)
            except Exception:  # a bad notice must not take the IO thread down
                logger.exception("client: could not follow the coordinator's scale notice")
        self._balancer.on_snapshot(snap)
        if self._follow_liveness:
            try:
                self._apply_liveness(snap)
            except Exception:  # a bad notice must not take the IO thread down
                logger.exception("client: could not apply the coordinator's liveness notice")

    def _apply_liveness(self, snap: StatsSnapshot) -> None:
        """Deaths and restarts as the coordinator publishes them (snapshots arrive in order)."""
        for ep in self.endpoints.engines:
            if ep.rank in snap.dead:
                if ep.rank not in self._dead:
                    cause = _cause(snap.dead[ep.rank])
                    self._do_mark_dead(EngineDeadError(ep.rank, ep.node_id, cause, "reported by the coordinator"))
            elif ep.rank in self._dead or ep.rank in snap.moved:
                addresses = snap.moved.get(ep.rank, ep.input_addresses)
                node = snap.nodes.get(ep.rank, ep.node_id)  # a rank re-added may sit on another node
                self._do_revive(EngineEndpoint(ep.rank, node, addresses))

    def _on_output_batch(self, frames: list[bytes], sock: zmq.Socket[bytes]) -> None:
        try:
            batch = output_decoder(_one_frame(frames))
        except ProtocolError as exc:
            self._drops.drop(self._sender(sock), str(exc))
            return
        for out in batch.outputs:
            self._deliver(out, batch.rank)
        if batch.utility is not None:
            self._calls.resolve(batch.utility)

    def _deliver(self, out: Output, rank: int) -> None:
        state = self._requests.get(out.request_id)
        if state is None or state.rank != rank:
            # Aborted, or moved to another rank (failed over, or off a draining one):
            # a late output of the rank it left must not join its answer there.
            return
        if out.finished:
            del self._requests[out.request_id]
            self._balancer.on_finished(state.rank)
        state.deliver(out)

    def _do_submit(
        self, request: Request, pinned: int | None, listener: Listener, retryable: bool, handle: RequestHandle | None
    ) -> None:
        state = self._admit(Submission(request, pinned, listener, retryable, handle), _NONE)
        if state is not None:
            self._send_request(state)

    def _admit(self, item: Submission, batch_ids: Collection[str]) -> RequestState | None:
        """Check one submission and pick its rank; None (and the listener told why) if it cannot go."""
        rid, pinned, listener = item.request.request_id, item.rank, item.listener
        if rid in self._requests or rid in batch_ids:
            listener(ConfigError(f"request_id={rid!r}: already in flight"))
            return None
        if pinned is not None and pinned in self._dead:
            listener(self._dead[pinned])
            return None
        if pinned is not None and pinned >= self._balancer.size:
            listener(ConfigError(f"rank={pinned}: the cluster was scaled to {self._balancer.size} ranks"))
            return None
        try:
            rank = pinned if pinned is not None else self._balancer.choose(self._dead)
        except ConfigError as exc:
            listener(next(iter(self._dead.values()), exc))
            return None
        return RequestState(item.request, rank, listener, item.retryable, item.handle)

    def _do_submit_many(self, items: list[Submission]) -> None:
        by_rank: dict[int, list[RequestState]] = {}
        ids: set[str] = set()
        for item in items:
            state = self._admit(item, ids)
            if state is None:
                continue
            ids.add(item.request.request_id)
            self._balancer.on_sent(state.rank)  # counted now, so the next choice sees it
            by_rank.setdefault(state.rank, []).append(state)
        for rank, states in by_rank.items():
            for _ in states:
                self._balancer.undo_sent(rank)  # the send below books what really goes
            self._send_batch(rank, states)

    def _send_batch(self, rank: int, states: list[RequestState]) -> None:
        """One message for every request of the batch that goes to ``rank``."""
        if len(states) == 1:
            self._send_request(states[0])
            return
        wave = self._balancer.wave
        for state in states:
            state.request.wave = wave
        body = encode(RequestBatch([state.request for state in states]))
        if len(body) > self._io.opts.max_message_bytes:  # too big together: each on its own
            for state in states:
                self._send_request(state)
            return
        if self.endpoints.lockstep and self._balancer.note_first_request():
            self._io.to_coordinator(FirstRequest(rank=rank, wave=wave))
        if not self._io.send_input(rank, RequestType.ADD_MANY, body):
            for state in states:
                state.deliver(RaydpError(f"engine rank {rank} is not accepting input (queue full)"))
            return
        for state in states:
            self._requests[state.request.request_id] = state
            self._balancer.on_sent(rank)
            if state.handle is not None:
                state.handle.rank = rank

    def _send_request(self, state: RequestState) -> None:
        request, rank = state.request, state.rank
        request.wave = self._balancer.wave
        body = encode(request)
        if len(body) > self._io.opts.max_message_bytes:  # refused before it can wake a paused cluster
            limit = self._io.opts.max_message_bytes
            why = f"prompt_token_ids: the request is {len(body)} bytes, over max_message_bytes={limit}"
            state.deliver(ConfigError(why))
            return
        if self.endpoints.lockstep and self._balancer.note_first_request():
            self._io.to_coordinator(FirstRequest(rank=rank, wave=request.wave))
        if not self._io.send_input(rank, RequestType.ADD, body):
            state.deliver(RaydpError(f"engine rank {rank} is not accepting input (queue full)"))
            return
        self._requests[request.request_id] = state
        self._balancer.on_sent(rank)
        if state.handle is not None:
            state.handle.rank = rank

    def _do_abort(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self._balancer.on_finished(state.rank)
        if state.rank not in self._dead:
            self._io.send_input(state.rank, RequestType.ABORT, encode(Abort([request_id])))
        state.deliver(Output(request_id, [], True, "abort"))

    def _do_call(self, rank: int, call_id: int, method: str, future: Future[Any], body: bytes) -> None:
        if rank in self._dead:
            future.set_exception(self._dead[rank])
            return
        if not self._io.send_input(rank, RequestType.UTILITY, body):
            future.set_exception(RaydpError(f"engine rank {rank} is not accepting input (queue full)"))
            return
        self._calls.add(call_id, rank, method, future)

    def _do_mark_dead(self, error: EngineDeadError) -> None:
        self._dead[error.rank] = error
        self._fail_rank(error.rank, error)

    def _fail_rank(self, rank: int, error: EngineDeadError) -> None:
        """Fail (or move, if retryable and nothing streamed yet) the requests on ``rank``;
        fail its pending utility calls (the engine that would answer them is gone)."""
        self._calls.fail(error, rank)
        for rid, state in list(self._requests.items()):
            if state.rank != rank:
                continue
            del self._requests[rid]
            self._balancer.on_finished(state.rank)
            if state.retryable and not state.got_output and len(self._dead) < len(self.endpoints.engines):
                state.rank = self._balancer.choose(self._dead)
                self._send_request(state)
            else:
                state.deliver(error)

    def _do_revive(self, endpoint: EngineEndpoint) -> None:
        if endpoint == self.endpoints.engines[endpoint.rank]:
            self._dead.pop(endpoint.rank, None)
            return
        self._io.reconnect(endpoint)
        self.endpoints = self.endpoints.with_engine(endpoint)
        self._dead.pop(endpoint.rank, None)
        # Whatever is still booked on the rank was on the engine that died; a
        # retryable request may go to the new one, over the new socket.
        gone = EngineDeadError(endpoint.rank, endpoint.node_id, DeathCause.UNKNOWN, "the rank was restarted")
        self._fail_rank(endpoint.rank, gone)

    def _do_rescale(self, engines: list[EngineEndpoint], size: int, drain_timeout_s: float | None) -> None:
        old = len(self.endpoints.engines)
        for ep in engines[old:]:
            self._io.add_engine(ep)
        for rank in range(old - 1, len(engines) - 1, -1):
            self._remove_rank(rank, ScaleDownError(rank, len(engines), drain_timeout_s))
        self.endpoints = msgspec.structs.replace(self.endpoints, engines=engines)
        self._balancer.resize(len(engines), size)
        logger.info("client: %d ranks, routing to %d (was %d)", len(engines), size, old)
        self._move_off_draining(size)

    def _remove_rank(self, rank: int, error: ScaleDownError) -> None:
        self._calls.fail(error, rank)
        for rid, state in list(self._requests.items()):
            if state.rank == rank:
                del self._requests[rid]
                state.deliver(error)
        self._dead.pop(rank, None)
        self._io.remove_last_engine()

    def _move_off_draining(self, size: int) -> None:
        """Retryable requests with no output yet need not wait for a draining rank: move them."""
        for rid, state in list(self._requests.items()):
            if state.rank < size or not state.retryable or state.got_output:
                continue
            self._io.send_input(state.rank, RequestType.ABORT, encode(Abort([rid])))
            del self._requests[rid]
            self._balancer.on_finished(state.rank)
            try:
                state.rank = self._balancer.choose(self._dead)
            except ConfigError as exc:
                state.deliver(exc)
                continue
            self._send_request(state)

    def _fail_everything(self, error: RaydpError) -> None:
        for state in self._requests.values():
            state.deliver(error)
        self._requests.clear()
        self._calls.fail(error)


def _cause(text: str) -> DeathCause:
    try:
        return DeathCause(text)
    except ValueError:
        return DeathCause.UNKNOWN


def _one_frame(frames: list[bytes]) -> bytes:
    """The body of a message to a client: every one is a single frame."""
    if len(frames) != 1:
        raise ProtocolError(f"a message of {len(frames)} frames (want 1)")
    return frames[0]
