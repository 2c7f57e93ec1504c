"""A client's request table: which rank each in-flight request is on, which ranks are dead,
what the balancer knows; sending, delivering, failing over, following scale changes.

Used only by the thread holding the client's lock (:mod:`raydp.client.client`),
so nothing here locks; ``tell_reader`` wakes a caller that polls for its own
answer when something reached it behind its back.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from raydp.client.balancer import LoadBalancer
from raydp.client.calls import PendingCalls
from raydp.client.membership import membership
from raydp.client.pools import KvWaits, pool_of, wants_prefill_first
from raydp.client.requests import RequestState, Submission
from raydp.client.sockets import ClientSockets
from raydp.errors import (
    ConfigError,
    DeathCause,
    EngineDeadError,
    KVTransferError,
    ProtocolError,
    RaydpError,
    ScaleDownError,
)
from raydp.wire.codec import encode
from raydp.wire.control import CacheWanted, FirstRequest, StatsSnapshot, snapshot_decoder
from raydp.wire.dropped import DropLog
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import Abort, Output, RequestBatch, RequestType, output_decoder

logger = logging.getLogger("raydp.client.client")
_NONE: frozenset[str] = frozenset()  # a single submit has no batch to clash with


class RequestRouter:
    """The request table of one :class:`~raydp.client.client.Client`; see the module docstring."""

    def __init__(
        self,
        endpoints: ClusterEndpoints,
        io: ClientSockets,
        balancer: LoadBalancer,
        *,
        follow_liveness: bool,
        last_heard: float,
    ) -> None:
        self.endpoints, self.io, self.balancer = endpoints, io, balancer
        # Clients in the launching process hear of deaths from the manager directly;
        # every other client (API servers, attached notebooks) from the coordinator.
        self.follow_liveness = follow_liveness
        # Wakes a caller polling for its own answer; set by the client's ClientTurns.
        self.tell_reader: Callable[[], None] = _nobody
        self.requests: dict[str, RequestState] = {}
        self.calls = PendingCalls()
        self.dead: dict[int, EngineDeadError] = {}
        self.last_snapshot: StatsSnapshot | None = None
        self.last_heard = last_heard
        self._drops = DropLog(logger, "client")
        # Every send of a request gets a new number, echoed in its outputs: what
        # a rank still sends for an aborted or moved submission can never be taken
        # for the answer to a later one under the same id.
        self._seqs = itertools.count(1)
        self._cache_asked: dict[int, float] = {}  # rank -> when this client last asked for its whole picture
        self.migrations = 0  # streams moved to another rank after their rank died (exported by API servers)
        self.kv_waits = KvWaits()  # P/D: requests whose decode rank has not made a token yet (Client sets the bound)

    def sender(self, sock: zmq.Socket[bytes]) -> str:
        """Who sent on ``sock``, as a dropped message names it: its role and the address it connects to."""
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if sock is self.io.stats:
            return f"coordinator publish {address}"
        rank = next((r for r, s in enumerate(self.io.engines) if s is sock), "?")
        return f"rank {rank} {address}"

    def on_snapshot(self, frames: list[bytes]) -> None:
        try:
            snap = snapshot_decoder(_one_frame(frames))
        except ProtocolError as exc:
            self._drops.drop(self.sender(self.io.stats), str(exc))
            return
        self.last_snapshot = snap
        self.last_heard = time.monotonic()
        if self.follow_liveness:
            try:
                engines, size = membership(self.endpoints.engines, snap)
                if len(engines) != len(self.endpoints.engines) or size != self.balancer.size:
                    self.rescale(engines, size, None)
            except Exception:  # a bad notice must not take the IO thread down
                logger.exception("client: could not follow the coordinator's scale notice")
        try:
            self._ask_for_pictures(self.balancer.on_snapshot(snap))
        except Exception:  # a bad snapshot must not take the IO thread down
            logger.exception("client: could not apply the coordinator's snapshot")
        if self.follow_liveness:
            try:
                self._apply_liveness(snap)
            except Exception:  # a bad notice must not take the IO thread down
                logger.exception("client: could not apply the coordinator's liveness notice")

    def _ask_for_pictures(self, ranks: list[int]) -> None:
        """Ask for the whole cache pictures this client fell behind on, each at most once a second."""
        now = time.monotonic()
        for rank in ranks:
            if now - self._cache_asked.get(rank, float("-inf")) >= 1.0:
                self._cache_asked[rank] = now
                self.io.to_coordinator(CacheWanted(rank=rank))

    def _apply_liveness(self, snap: StatsSnapshot) -> None:
        """Deaths and restarts as the coordinator publishes them (snapshots arrive in order)."""
        for ep in self.endpoints.engines:
            if ep.rank in snap.dead:
                if ep.rank not in self.dead:
                    cause = _cause(snap.dead[ep.rank])
                    self.mark_dead(EngineDeadError(ep.rank, ep.node_id, cause, "reported by the coordinator"))
            elif ep.rank in self.dead or ep.rank in snap.moved:
                addresses = snap.moved.get(ep.rank, ep.input_addresses)
                node = snap.nodes.get(ep.rank, ep.node_id)  # a rank re-added may sit on another node
                self.revive(EngineEndpoint(ep.rank, node, addresses))

    def on_output_batch(self, frames: list[bytes], sock: zmq.Socket[bytes]) -> None:
        try:
            batch = output_decoder(_one_frame(frames))
        except ProtocolError as exc:
            self._drops.drop(self.sender(sock), str(exc))
            return
        for out in batch.outputs:
            self._deliver(out, batch.rank)
        if batch.utility is not None:
            self.calls.resolve(batch.utility)

    def _deliver(self, out: Output, rank: int) -> None:
        state = self.requests.get(out.request_id)
        if state is None or state.rank != rank or out.seq != state.request.seq:
            # Aborted (and perhaps submitted again), or moved to another rank: a late
            # output of an earlier submission must not join this one's answer.
            return
        if self.kv_waits:
            self.kv_waits.arrived(out.request_id)
        if out.finished:
            del self.requests[out.request_id]
            self.balancer.on_finished(state.rank)
            if state.handoff and out.error is None and out.finish_reason == "length":
                self._hand_off(state, out)
                return
        state.deliver(out)

    def _hand_off(self, state: RequestState, first: Output) -> None:
        """P/D: the prefill rank made the first token; stream it, and go on from it on a decode rank."""
        state.handoff = False
        state.deliver(msgspec.structs.replace(first, finished=False, finish_reason=None))
        # Also in any later migration: the rank that ends the stream removes what the prefill left.
        state.original = msgspec.structs.replace(state.original, prefilled=len(state.original.prompt_token_ids))
        continuation = state.continuation()
        if continuation is None:  # the budget was one token after all
            state.deliver(Output(first.request_id, [], True, "length", seq=first.seq))
            return
        state.request = continuation
        try:
            state.rank = self._choose(state)
        except ConfigError as exc:
            state.deliver(next(iter(self.dead.values()), exc))
            return
        self._send_request(state)
        if state.request.request_id in self.requests:
            self.kv_waits.start(state.request.request_id, state.request.seq, time.monotonic())

    def expire_kv(self, now: float) -> None:
        """P/D: fail, typed, the requests whose decode rank made no token in time (their KV never came)."""
        late = self.kv_waits.expired(now, lambda rid: self.requests[rid].request.seq if rid in self.requests else None)
        for rid in late:
            state = self.requests.pop(rid)
            self.balancer.on_finished(state.rank)
            if state.rank not in self.dead:
                self.io.send_input(state.rank, RequestType.ABORT, encode(Abort([rid])))
            node = self.endpoints.engines[state.rank].node_id
            state.deliver(KVTransferError(rid, state.rank, node, self.kv_waits.timeout_s))
        if late:
            self.tell_reader()

    def submit(self, item: Submission) -> None:
        state = self._admit(item, _NONE)
        if state is not None:
            self._send_request(state)

    def _admit(self, item: Submission, batch_ids: Collection[str]) -> RequestState | None:
        """Check one submission and pick its rank; None (and the listener told why) if it cannot go."""
        rid, pinned, listener = item.request.request_id, item.rank, item.listener
        if rid in self.requests or rid in batch_ids:
            listener(ConfigError(f"request_id={rid!r}: already in flight"))
            return None
        if pinned is not None and pinned in self.dead:
            listener(self.dead[pinned])
            return None
        if pinned is not None and pinned >= self.balancer.size:
            listener(ConfigError(f"rank={pinned}: the cluster was scaled to {self.balancer.size} ranks"))
            return None
        state = RequestState(item.request, -1, listener, item.retryable, item.handle, item.migrations)
        if wants_prefill_first(self.endpoints.prefill_ranks, state, pinned, item.whole):
            state.prefill_first()
        try:
            state.rank = pinned if pinned is not None else self._choose(state)
        except ConfigError as exc:
            listener(next(iter(self.dead.values()), exc))
            return None
        return state

    def _choose(self, state: RequestState) -> int:
        """A live rank for ``state``'s next send, in its pool where ranks are pooled (:mod:`raydp.client.pools`)."""
        among, by_prompt = pool_of(state, self.endpoints.prefill_ranks, len(self.endpoints.engines))
        prompt = state.request.prompt_token_ids if by_prompt else None
        prefill = among is not None and by_prompt  # prefix affinity pays where prompts are computed
        return self.balancer.choose(self.dead, prompt, state.request.adapter, among, by_prefix=prefill)

    def submit_many(self, items: list[Submission]) -> None:
        if len(items) <= 1:  # the usual inline case: no batch to book
            for item in items:
                self.submit(item)
            return
        by_rank: dict[int, list[RequestState]] = {}
        ids: set[str] = set()
        for item in items:
            state = self._admit(item, ids)
            if state is None:
                continue
            ids.add(item.request.request_id)
            # Counted now: the next choice sees it.
            self.balancer.on_sent(state.rank, item.request.max_tokens, item.request.adapter)
            by_rank.setdefault(state.rank, []).append(state)
        for rank, states in by_rank.items():
            for state in states:
                self.balancer.undo_sent(rank, state.request.max_tokens)  # the send below books what really goes
            self._send_batch(rank, states)

    def _send_batch(self, rank: int, states: list[RequestState]) -> None:
        """One message for every request of the batch that goes to ``rank``."""
        if len(states) == 1:
            self._send_request(states[0])
            return
        wave = self.balancer.wave
        for state in states:
            state.request.wave, state.request.seq = wave, next(self._seqs)
        body = encode(RequestBatch([state.request for state in states]))
        if len(body) > self.io.opts.max_message_bytes:  # too big together: each on its own
            for state in states:
                self._send_request(state)
            return
        if self.endpoints.lockstep and self.balancer.note_first_request():
            self.io.to_coordinator(FirstRequest(rank=rank, wave=wave))
        if not self.io.send_input(rank, RequestType.ADD_MANY, body):
            for state in states:
                state.deliver(RaydpError(f"engine rank {rank} is not accepting input (queue full)"))
            return
        for state in states:
            self.requests[state.request.request_id] = state
            self.balancer.on_sent(rank, state.request.max_tokens, state.request.adapter)
            if state.handle is not None:
                state.handle.rank = rank

    def _send_request(self, state: RequestState) -> None:
        request, rank = state.request, state.rank
        request.wave, request.seq = self.balancer.wave, next(self._seqs)
        body = encode(request)
        if len(body) > self.io.opts.max_message_bytes:  # refused before it can wake a paused cluster
            limit = self.io.opts.max_message_bytes
            why = f"prompt_token_ids: the request is {len(body)} bytes, over max_message_bytes={limit}"
            state.deliver(ConfigError(why))
            return
        if self.endpoints.lockstep and self.balancer.note_first_request():
            self.io.to_coordinator(FirstRequest(rank=rank, wave=request.wave))
        if not self.io.send_input(rank, RequestType.ADD, body):
            state.deliver(RaydpError(f"engine rank {rank} is not accepting input (queue full)"))
            return
        self.requests[request.request_id] = state
        self.balancer.on_sent(rank, request.max_tokens, request.adapter)
        if state.handle is not None:
            state.handle.rank = rank

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        self.balancer.on_finished(state.rank)
        if state.rank not in self.dead:
            self.io.send_input(state.rank, RequestType.ABORT, encode(Abort([request_id])))
        state.deliver(Output(request_id, [], True, "abort"))

    def call(self, rank: int, call_id: int, method: str, future: Future[Any], body: bytes) -> None:
        if rank in self.dead:
            future.set_exception(self.dead[rank])
            return
        if not self.io.send_input(rank, RequestType.UTILITY, body):
            future.set_exception(RaydpError(f"engine rank {rank} is not accepting input (queue full)"))
            return
        self.calls.add(call_id, rank, method, future)

    def move_coordinator(self, coord: CoordinatorEndpoints) -> bool:
        """Follow a coordinator that moved to another node; whether it had (False: already there)."""
        if coord == self.endpoints.coordinator:
            return False
        logger.warning(
            "client: the coordinator of cluster %r moved to node %s", self.endpoints.name, coord.node_id[:12]
        )
        self.endpoints = msgspec.structs.replace(self.endpoints, coordinator=coord)
        self.io.move_coordinator(coord)
        self.last_heard = time.monotonic()
        return True

    def mark_dead(self, error: EngineDeadError) -> None:
        self.dead[error.rank] = error
        self.balancer.adapters.forget(error.rank)
        self._fail_rank(error.rank, error)

    def _fail_rank(self, rank: int, error: EngineDeadError) -> None:
        """Fail (or move, if retryable and nothing streamed yet) the requests on ``rank``;
        fail its pending utility calls (the engine that would answer them is gone)."""
        self.calls.fail(error, rank)
        for rid, state in list(self.requests.items()):
            if state.rank != rank:
                continue
            del self.requests[rid]
            self.balancer.on_finished(state.rank)
            try:
                # A P/D request still on its prefill rank has streamed nothing: it is always sent again.
                if (state.retryable or state.handoff) and not state.got_output:
                    state.rank = self._choose(state)
                    self._send_request(state)
                elif state.migrations_left > 0:
                    self._migrate(state, error)
                else:
                    state.deliver(error)
            except ConfigError:  # no live rank (of its pool) left to go on
                state.deliver(error)
        self.tell_reader()

    def _migrate(self, state: RequestState, error: EngineDeadError) -> None:
        """Continue a stream cut by its rank's death on a live rank, from its last token.

        The new submission's prompt is the original prompt plus every token
        streamed so far, its ``max_tokens`` what is left; the caller's stream
        goes on under the same id, with nothing repeated or dropped (a greedy
        request gives what an uninterrupted one would).
        """
        state.migrations_left -= 1
        continuation = state.continuation()
        if continuation is None:  # every token was out; only the last message died with the rank
            state.deliver(Output(state.request.request_id, [], True, "length", seq=state.request.seq))
            return
        state.request = continuation
        state.rank = self._choose(state)
        self.migrations += 1
        logger.info(
            "client: request %s moved from dead rank %d to rank %d after %d tokens (%d moves left)",
            continuation.request_id,
            error.rank,
            state.rank,
            len(state.streamed or []),
            state.migrations_left,
        )
        self._send_request(state)

    def revive(self, endpoint: EngineEndpoint) -> None:
        if endpoint == self.endpoints.engines[endpoint.rank]:
            self.dead.pop(endpoint.rank, None)
            return
        self.io.reconnect(endpoint)
        self.endpoints = self.endpoints.with_engine(endpoint)
        self.dead.pop(endpoint.rank, None)
        # Whatever is still booked on the rank was on the engine that died; a
        # retryable request may go to the new one, over the new socket.
        gone = EngineDeadError(endpoint.rank, endpoint.node_id, DeathCause.UNKNOWN, "the rank was restarted")
        self._fail_rank(endpoint.rank, gone)

    def rescale(self, engines: list[EngineEndpoint], size: int, drain_timeout_s: float | None) -> None:
        old = len(self.endpoints.engines)
        for ep in engines[old:]:
            self.io.add_engine(ep)
        for rank in range(old - 1, len(engines) - 1, -1):
            self._remove_rank(rank, ScaleDownError(rank, len(engines), drain_timeout_s))
        self.endpoints = msgspec.structs.replace(self.endpoints, engines=engines)
        self.balancer.resize(len(engines), size)
        logger.info("client: %d ranks, routing to %d (was %d)", len(engines), size, old)
        self._move_off_draining(size)

    def _remove_rank(self, rank: int, error: ScaleDownError) -> None:
        self.calls.fail(error, rank)
        for rid, state in list(self.requests.items()):
            if state.rank == rank:
                del self.requests[rid]
                state.deliver(error)
        self.tell_reader()
        self.dead.pop(rank, None)
        self.io.remove_last_engine()

    def _move_off_draining(self, size: int) -> None:
        """Retryable requests with no output yet need not wait for a draining rank: move them."""
        for rid, state in list(self.requests.items()):
            if state.rank < size or not state.retryable or state.got_output:
                continue
            self.io.send_input(state.rank, RequestType.ABORT, encode(Abort([rid])))
            del self.requests[rid]
            self.balancer.on_finished(state.rank)
            try:
                state.rank = self._choose(state)
            except ConfigError as exc:
                state.deliver(exc)
                continue
            self._send_request(state)

    def fail_everything(self, error: RaydpError) -> None:
        for state in self.requests.values():
            state.deliver(error)
        self.requests.clear()
        self.calls.fail(error)
        self.tell_reader()


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


def _nobody() -> None:
    """No caller reads for itself (until a ClientTurns takes the router)."""
