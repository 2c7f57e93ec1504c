"""A client's request table: which rank each in-flight request is on, which ranks are dead,
what the balancer knows; sending, delivering, failing over, following scale changes.

Used only by the thread holding the client's lock (:mod:`raydp.client.client`),
so nothing here locks; ``tell_reader`` wakes a caller that polls for its own
answer when something reached it behind its back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from raydp.client.balancer import LoadBalancer
from raydp.client.calls import PendingCalls
from raydp.client.feed import CoordinatorFeed, one_frame
from raydp.client.membership import liveness, membership
from raydp.client.pools import KvWaits, pool_of, wants_prefill_first
from raydp.client.requests import RequestState, Submission
from raydp.client.sending import RequestSender
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
from raydp.wire.control import StatsSnapshot
from raydp.wire.dropped import DropLog
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import Abort, Output, RequestType, output_decoder

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
        # Wakes a caller polling for its own answer; set by the client's ClientTurns (none reads until then).
        self.tell_reader: Callable[[], None] = lambda: None
        self.requests: dict[str, RequestState] = {}
        self.calls = PendingCalls()
        self.dead: dict[int, EngineDeadError] = {}
        self._drops = DropLog(logger, "client")
        self.feed = CoordinatorFeed(io.to_coordinator, self._drops, last_heard)
        self.out = RequestSender(io, balancer, self.requests, endpoints.lockstep)
        self.migrations = 0  # streams moved to another rank after their rank died (exported by API servers)
        self.kv_waits = KvWaits()  # P/D: requests whose decode rank has not made a token yet (Client sets the bound)

    def on_snapshot(self, frames: list[bytes]) -> None:
        snap = self.feed.take(frames, self.io.describe(self.io.stats))
        if snap is None:
            return
        if self.follow_liveness:
            try:
                engines, size = membership(self.endpoints.engines, snap)
                if len(engines) != len(self.endpoints.engines) or size != self.balancer.size:
                    self.rescale(engines, size, None)
                if snap.prefill_ranks > 0:  # a pool was resized since launch (raydp.orchestration.pools)
                    self.move_pools(snap.prefill_ranks)
            except Exception:  # a bad notice must not take the IO thread down
                logger.exception("client: could not follow the coordinator's scale notice")
        try:
            self.feed.ask_for_pictures(self.balancer.on_snapshot(snap))
        except Exception:  # a bad snapshot must not take the IO thread down
            logger.exception("client: could not apply the coordinator's snapshot")
        if self.follow_liveness:
            try:
                self._apply_liveness(snap)
            except Exception:  # a bad notice must not take the IO thread down
                logger.exception("client: could not apply the coordinator's liveness notice")

    def _apply_liveness(self, snap: StatsSnapshot) -> None:
        """Deaths and restarts as the coordinator publishes them (snapshots arrive in order)."""
        deaths, revived = liveness(self.endpoints.engines, self.dead, snap)
        for death in deaths:
            self.mark_dead(death)
        for endpoint in revived:
            self.revive(endpoint)

    def on_output_batch(self, frames: list[bytes], sock: zmq.Socket[bytes]) -> None:
        try:
            batch = output_decoder(one_frame(frames))
        except ProtocolError as exc:
            self._drops.drop(self.io.describe(sock), str(exc))
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
        if not self._continued(state):  # the budget was one token after all
            return
        try:
            state.rank = self._choose(state)
        except ConfigError as exc:
            state.deliver(next(iter(self.dead.values()), exc))
            return
        self.out.send(state)
        if state.request.request_id in self.requests:
            self.kv_waits.start(state.request.request_id, state.request.seq, time.monotonic())

    def expire_kv(self, now: float) -> None:
        """P/D: fail, typed, the requests whose decode rank made no token in time (their KV never came)."""
        late = self.kv_waits.expired(now, lambda rid: self.requests[rid].request.seq if rid in self.requests else None)
        for rid in late:
            state = self._withdraw(rid)
            assert state is not None, "expired() names only requests in flight"
            node = self.endpoints.engines[state.rank].node_id
            state.deliver(KVTransferError(rid, state.rank, node, self.kv_waits.timeout_s))
        if late:
            self.tell_reader()

    def submit(self, item: Submission) -> None:
        state = self._admit(item, _NONE)
        if state is not None:
            self.out.send(state)

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
            self.out.send_batch(rank, states)

    def abort(self, request_id: str) -> None:
        state = self._withdraw(request_id)
        if state is not None:
            state.deliver(Output(request_id, [], True, "abort"))

    def _withdraw(self, request_id: str) -> RequestState | None:
        """Take ``request_id`` off the table and off its rank (if that rank lives); None if not in flight."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.balancer.on_finished(state.rank)
            if state.rank not in self.dead:
                self.io.send_input(state.rank, RequestType.ABORT, encode(Abort([request_id])))
        return state

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
        self.feed.heard()
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
                    self.out.send(state)
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
        if not self._continued(state):  # every token was out; only the last message died with the rank
            return
        state.rank = self._choose(state)
        self.migrations += 1
        logger.info(
            "client: request %s moved from dead rank %d to rank %d after %d tokens (%d moves left)",
            state.request.request_id,
            error.rank,
            state.rank,
            len(state.streamed or []),
            state.migrations_left,
        )
        self.out.send(state)

    def _continued(self, state: RequestState) -> bool:
        """Point ``state`` at its continuation; False (its stream ended) if no token is left to make."""
        continuation = state.continuation()
        if continuation is None:
            state.deliver(Output(state.request.request_id, [], True, "length", seq=state.request.seq))
            return False
        state.request = continuation
        return True

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

    def move_pools(self, prefill_ranks: int) -> None:
        """P/D: new sends go by this boundary; requests already on a rank that switched pools stay there."""
        if prefill_ranks != self.endpoints.prefill_ranks:
            logger.info("client: ranks 0..%d prefill (was 0..%d)", prefill_ranks - 1, self.endpoints.prefill_ranks - 1)
            self.endpoints = msgspec.structs.replace(self.endpoints, prefill_ranks=prefill_ranks)

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
            self._withdraw(rid)
            try:
                state.rank = self._choose(state)
            except ConfigError as exc:
                state.deliver(exc)
                continue
            self.out.send(state)

    def fail_everything(self, error: RaydpError) -> None:
        for state in self.requests.values():
            state.deliver(error)
        self.requests.clear()
        self.calls.fail(error)
        self.tell_reader()
