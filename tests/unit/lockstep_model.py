"""One model of lockstep ranks, the coordinator and clients on FIFO channels, for the state machines.

``test_waves_stateful.py`` (request waves) and ``test_scaling_properties.py``
(the gang's hold and regroup) both wire the real pure logic together the way
the engine loop, the coordinator and the clients do, every message encoded
with :mod:`raydp.wire.codec` and carried on one FIFO channel per
sender/receiver pair. What they share is here: the channels, the clients,
the rank's request queue, the coordinator's side, and the rules that send,
deliver and turn. Each machine says what a rank does with a request, a
broadcast and a loop turn.

Channel keys::

    ("req", c, r)    client c -> engine r (engine input ROUTER)
    ("bcast", r)     coordinator -> engine r (broadcast SUB)
    ("c2coord", c)   client c -> coordinator (PUSH)
    ("e2coord", r)   engine r -> coordinator (PUSH)
    ("snap", c)      coordinator -> client c (stats PUB)
    ("l2coord",)     launcher -> coordinator (PUSH; the hold machine only)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from raydp.coordinator.state import CoordinatorState
from raydp.wire.codec import encode
from raydp.wire.control import EngineStats, FirstRequest, coordinator_decoder, snapshot_decoder
from raydp.wire.protocol import Request, RequestType, decode_input

Key = tuple[Any, ...]
COORDINATOR_INBOXES = ("c2coord", "e2coord", "l2coord")


@dataclass
class ModelClient:
    wave: int = 0  # from the latest snapshot
    running: bool = False  # the snapshot's flag, set locally when it sends FirstRequest
    seq: int = 0


def channel_keys(n_ranks: int, n_clients: int, launcher: bool = False) -> list[Key]:
    keys: list[Key] = [("req", c, r) for c in range(n_clients) for r in range(n_ranks)]
    keys += [("bcast", r) for r in range(n_ranks)] + [("e2coord", r) for r in range(n_ranks)]
    keys += [("c2coord", c) for c in range(n_clients)] + [("snap", c) for c in range(n_clients)]
    return keys + ([("l2coord",)] if launcher else [])


class LockstepModel(RuleBasedStateMachine):
    """The shared world of the lockstep machines; see the module docstring.

    Subclasses fill ``ranks`` (each with ``queue``, ``blocked``, ``last_stats``
    and ``waves``), call :meth:`_open`, and implement :meth:`_on_request`,
    :meth:`_on_broadcast`, :meth:`_turn`, :meth:`_can_step` and :meth:`_describe`.
    """

    ranks: list[Any]
    max_work = 4

    def __init__(self) -> None:
        super().__init__()
        self.ranks = []
        self.clients: list[ModelClient] = []
        self.channels: dict[Key, deque[bytes]] = {}
        self.coord = CoordinatorState(engine_count=0)
        self.clock = 0.0
        self.sent: set[str] = set()
        self.finished: set[str] = set()
        self.next_id = 0
        self.seen_rank_waves: list[int] = []

    def _open(self, n_ranks: int, n_clients: int, launcher: bool = False) -> None:
        # Binary-exact intervals so the model's clock arithmetic has no rounding.
        self.coord = CoordinatorState(engine_count=n_ranks, stats_interval_s=0.125, heartbeat_interval_s=1.0)
        self.channels = {k: deque() for k in channel_keys(n_ranks, n_clients, launcher)}
        self.clients = [ModelClient() for _ in range(n_clients)]
        self.seen_rank_waves = [0] * n_ranks

    # ---- what each machine's ranks do ----------------------------------------------------

    def _on_request(self, r: int, req: Request) -> None:
        raise NotImplementedError

    def _on_broadcast(self, r: int, body: bytes) -> None:
        raise NotImplementedError

    def _turn(self, r: int) -> None:
        raise NotImplementedError

    def _can_step(self, r: int) -> bool:
        raise NotImplementedError

    def _describe(self) -> str:
        raise NotImplementedError

    # ---- channels -----------------------------------------------------------------------

    def _push(self, key: Key, data: bytes) -> None:
        self.channels[key].append(data)

    def _readable(self, key: Key) -> bool:
        """Whether the receiver of ``key`` can read now (a rank in the all-reduce cannot)."""
        return bool(self.channels[key]) and not (key[0] in ("req", "bcast") and self.ranks[key[-1]].blocked)

    def _deliverable(self) -> list[Key]:
        return [k for k in self.channels if self._readable(k)]

    def _steppable(self) -> list[int]:
        return [r for r, rk in enumerate(self.ranks) if not rk.blocked and self._can_step(r)]

    def _broadcast(self, msg: Any) -> None:
        body = encode(msg)
        for r in range(len(self.ranks)):
            self._push(("bcast", r), body)

    def _deliver(self, key: Key) -> None:
        data = self.channels[key].popleft()
        kind = key[0]
        if kind == "req":
            req = decode_input(RequestType.ADD.value, data)
            assert isinstance(req, Request)
            self._on_request(key[2], req)
        elif kind == "bcast":
            self._on_broadcast(key[1], data)
        elif kind in COORDINATOR_INBOXES:
            out = self.coord.handle(coordinator_decoder(data))
            if out is not None:
                self._broadcast(out)
        else:
            c, snap = key[1], snapshot_decoder(data)
            client = self.clients[c]
            assert snap.seq > client.seq, f"client {c} got snapshot seq {snap.seq} after {client.seq}"
            client.seq, client.wave, client.running = snap.seq, snap.wave, snap.running

    def _publish_snapshot(self) -> bool:
        """The coordinator's snapshot, if one is due at the model's clock, to every client."""
        snap = self.coord.due_snapshot(self.clock)
        if snap is None:
            return False
        body = encode(snap)
        for c in range(len(self.clients)):
            self._push(("snap", c), body)
        return True

    # ---- a rank's work ----------------------------------------------------------------------

    def _work(self, r: int) -> None:
        """One step of every request on rank ``r``; its stats to the coordinator when they changed."""
        rk = self.ranks[r]
        for rid in list(rk.queue):
            rk.queue[rid] -= 1
            if rk.queue[rid] <= 0:
                del rk.queue[rid]
                self.finished.add(rid)
        stats = (0, len(rk.queue))
        if stats != rk.last_stats:
            rk.last_stats = stats
            self._push(("e2coord", r), encode(EngineStats(rank=r, waiting=stats[0], running=stats[1])))

    # ---- rules every machine has --------------------------------------------------------------

    @rule(data=st.data())
    def client_sends_request(self, data: st.DataObject) -> None:
        c = data.draw(st.integers(0, len(self.clients) - 1), label="client")
        r = data.draw(st.integers(0, len(self.ranks) - 1), label="rank")
        work = data.draw(st.integers(1, self.max_work), label="work")
        client = self.clients[c]
        rid = f"req-{self.next_id}"
        self.next_id += 1
        self.sent.add(rid)
        if not client.running:
            client.running = True
            self._push(("c2coord", c), encode(FirstRequest(rank=r, wave=client.wave)))
        self._push(("req", c, r), encode(Request(rid, [1, 2], work, wave=client.wave)))

    @precondition(lambda self: bool(self._deliverable()))
    @rule(data=st.data())
    def deliver_one(self, data: st.DataObject) -> None:
        self._deliver(data.draw(st.sampled_from(self._deliverable()), label="channel"))

    @precondition(lambda self: bool(self._steppable()))
    @rule(data=st.data())
    def engine_turn(self, data: st.DataObject) -> None:
        self._turn(data.draw(st.sampled_from(self._steppable()), label="rank"))

    @invariant()
    def rank_waves_never_go_backwards(self) -> None:
        for r, rk in enumerate(self.ranks):
            assert rk.waves.wave >= self.seen_rank_waves[r], f"rank {r} wave went back: {self._describe()}"
            self.seen_rank_waves[r] = rk.waves.wave


__all__ = ["Key", "LockstepModel", "ModelClient", "channel_keys"]
