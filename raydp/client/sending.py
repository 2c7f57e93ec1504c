"""Putting a client's requests on their ranks' input sockets (the router decides where; this sends).

Each send gets a new number (``seq``), echoed in its outputs: what a rank
still sends for an aborted or moved submission can never be taken for the
answer to a later one under the same id. A request over the message limit is
refused before it can wake a paused cluster; a lockstep wave's first request
tells the coordinator, which starts the wave on every rank; what went is
booked in the request table and the balancer's load, at once, so the next
choice sees it.
"""

from __future__ import annotations

import itertools

from raydp.client.balancer import LoadBalancer
from raydp.client.requests import RequestState
from raydp.client.sockets import ClientSockets
from raydp.errors import ConfigError, RaydpError
from raydp.wire.codec import encode
from raydp.wire.control import FirstRequest
from raydp.wire.protocol import RequestBatch, RequestType


class RequestSender:
    """Sends for one client's router; ``requests`` is the router's table, which this books sends in."""

    def __init__(
        self, io: ClientSockets, balancer: LoadBalancer, requests: dict[str, RequestState], lockstep: bool
    ) -> None:
        self.io, self.balancer, self.requests, self.lockstep = io, balancer, requests, lockstep
        self._seqs = itertools.count(1)

    def send_batch(self, rank: int, states: list[RequestState]) -> None:
        """One message for every request of the batch that goes to ``rank``."""
        if len(states) == 1:
            self.send(states[0])
            return
        wave = self.balancer.wave
        for state in states:
            state.request.wave, state.request.seq = wave, next(self._seqs)
        body = encode(RequestBatch([state.request for state in states]))
        if len(body) > self.io.opts.max_message_bytes:  # too big together: each on its own
            for state in states:
                self.send(state)
            return
        self._wake_gang(rank, wave)
        sent = self.io.send_input(rank, RequestType.ADD_MANY, body)
        for state in states:
            self._book(state, sent)

    def send(self, state: RequestState) -> None:
        request, rank = state.request, state.rank
        request.wave, request.seq = self.balancer.wave, next(self._seqs)
        body = encode(request)
        if len(body) > self.io.opts.max_message_bytes:  # refused before it can wake a paused cluster
            limit = self.io.opts.max_message_bytes
            why = f"prompt_token_ids: the request is {len(body)} bytes, over max_message_bytes={limit}"
            state.deliver(ConfigError(why))
            return
        self._wake_gang(rank, request.wave)
        self._book(state, self.io.send_input(rank, RequestType.ADD, body))

    def _wake_gang(self, rank: int, wave: int) -> None:
        """A lockstep cluster's first request of a wave: the coordinator starts the wave on every rank."""
        if self.lockstep and self.balancer.note_first_request():
            self.io.to_coordinator(FirstRequest(rank=rank, wave=wave))

    def _book(self, state: RequestState, sent: bool) -> None:
        """Record ``state`` as in flight on its rank, or fail it if its rank's queue refused it."""
        if not sent:
            state.deliver(RaydpError(f"engine rank {state.rank} is not accepting input (queue full)"))
            return
        self.requests[state.request.request_id] = state
        self.balancer.on_sent(state.rank, state.request.max_tokens, state.request.adapter)
        if state.handle is not None:
            state.handle.rank = state.rank
            if state.handle.ranks[-1:] != [state.rank]:
                state.handle.ranks.append(state.rank)
