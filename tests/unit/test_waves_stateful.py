"""Stateful model check of request waves: lockstep ranks + coordinator + clients.

The model wires the real pure logic (:class:`raydp.engine.waves.EngineWaves` per rank,
:class:`raydp.coordinator.state.CoordinatorState`) together the way the engine
loop, the coordinator actor and the clients do, with every message encoded
with :mod:`raydp.wire.codec` and carried on an explicit FIFO channel per
sender/receiver pair. Hypothesis picks which channel delivers next (so messages
of different senders interleave arbitrarily and snapshots reach clients late),
which rank takes a loop turn, and when clients send requests.

The periodic all-reduce is non-blocking, as in the engine: an interval into a
wave a rank *starts* one (it contributes its "has unfinished work" flag to the
next round and goes on); with one in flight, it *collects* it at the first
step an interval or more later at which every rank has started that round,
and never waits for it (a rank whose peer is behind keeps stepping), then
starts the next. When a round says nobody had work, the ranks *confirm* with a
barrier: a rank blocks until every rank is in it, then each applies the MAX
of their flags now.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule, run_state_machine_as_test

from raydp.engine.waves import EngineWaves, Sync
from raydp.wire.codec import encode
from raydp.wire.control import (
    FirstRequest,
    StartDPWave,
    StartWave,
    WaveComplete,
    coordinator_decoder,
    engine_broadcast_decoder,
)
from raydp.wire.protocol import Request
from tests.unit.lockstep_model import Key, LockstepModel

MAX_DRAIN_ACTIONS = 10_000


@dataclass
class Rank:
    waves: EngineWaves
    queue: dict[str, int] = field(default_factory=dict)  # request id -> steps of work left
    blocked: str = ""  # "confirm" (in the barrier); "" runs
    unfinished: bool = False  # what it contributed to the confirming barrier
    last_stats: tuple[int, int] = (0, 0)
    started: int = 0  # non-blocking rounds this rank has started


class WaveSystem(LockstepModel):
    """2-4 lockstep ranks, one coordinator, 1-2 clients, reordering channels."""

    ranks: list[Rank]

    def __init__(self) -> None:
        super().__init__()
        self.ignore_excluded = False
        self.seen_coord_wave = 0
        self.seen_client_waves: list[int] = []
        self.rounds: dict[int, dict[int, bool]] = {}  # round -> rank -> "has unfinished work"

    # ---- setup -------------------------------------------------------------------

    @initialize(
        n_ranks=st.integers(2, 4),
        n_clients=st.integers(1, 2),
        interval=st.integers(1, 3),
        ignore_excluded=st.booleans(),
    )
    def setup(self, n_ranks: int, n_clients: int, interval: int, ignore_excluded: bool) -> None:
        self._open(n_ranks, n_clients)
        self.ranks = [Rank(EngineWaves(rank=r, interval=interval)) for r in range(n_ranks)]
        # "Those whose rank == exclude may ignore it": check both engine choices.
        self.ignore_excluded = ignore_excluded
        self.seen_client_waves = [0] * n_clients

    # ---- what a rank does ------------------------------------------------------------------

    def _can_step(self, r: int) -> bool:
        rk = self.ranks[r]
        return rk.waves.should_step(bool(rk.queue)) and not self._spinning(rk)

    def _spinning(self, rk: Rank) -> bool:
        """Nothing to do but wait for a round a peer has not started. Its dummy steps change
        nothing, so the model does not take them (a scheduler could starve the peer with them);
        one left spinning at quiescence still fails the check that idle ranks do not run."""
        w = rk.waves
        return (
            not rk.queue
            and w.pending
            and w.steps + 1 - w.started_at >= w.interval
            and len(self.rounds.get(rk.started - 1, {})) < len(self.ranks)
        )

    def _on_request(self, r: int, req: Request) -> None:
        start = self.ranks[r].waves.on_request(req.wave)
        if start is not None:
            self._push(("e2coord", r), encode(StartWave(rank=r, wave=start)))
        self.ranks[r].queue[req.request_id] = req.max_tokens

    def _on_broadcast(self, r: int, body: bytes) -> None:
        msg = engine_broadcast_decoder(body)
        assert isinstance(msg, StartDPWave)
        if not (self.ignore_excluded and msg.exclude == r):
            self.ranks[r].waves.on_start_wave(msg.wave)

    def _turn(self, r: int) -> None:
        """One engine loop turn after input was read: step (real or dummy), maybe all-reduce."""
        rk = self.ranks[r]
        assert not rk.blocked and rk.waves.should_step(bool(rk.queue))
        self._work(r)
        contributed = self.rounds.get(rk.started - 1, {})
        sync = rk.waves.after_step(lambda: len(contributed) == len(self.ranks))
        if sync is Sync.START:
            self._start(r)
        elif sync is Sync.COLLECT:
            self._collect(r, contributed)

    def _start(self, r: int) -> None:
        """Contribute to the next round without waiting."""
        rk = self.ranks[r]
        self.rounds.setdefault(rk.started, {})[r] = bool(rk.queue)
        rk.started += 1
        rk.waves.on_started()

    def _collect(self, r: int, contributed: dict[int, bool]) -> None:
        """The round every rank started: confirm in the barrier, or start the next."""
        rk = self.ranks[r]
        assert len(contributed) == len(self.ranks), f"rank {r} collected a round a peer has not started"
        if rk.waves.on_collected(max(contributed.values()), False):
            rk.blocked, rk.unfinished = "confirm", bool(rk.queue)
            self._resolve_collective()
        else:
            self._start(r)

    def _resolve_collective(self) -> None:
        """The confirming barrier, once every rank is in it."""
        if not all(rk.blocked == "confirm" for rk in self.ranks):
            return
        global_unfinished = max(rk.unfinished for rk in self.ranks)
        before = [rk.waves.wave for rk in self.ranks]
        completed = []
        for rk in self.ranks:
            rk.blocked = ""
            completed.append(rk.waves.on_allreduce(global_unfinished))
        assert len(set(completed)) == 1, (
            f"ranks disagree on the completed wave after one all-reduce: {completed} (waves {before})"
        )
        if completed[0] is not None:
            self._push(("e2coord", 0), encode(WaveComplete(rank=0, wave=completed[0])))
        for r, rk in enumerate(self.ranks):
            if rk.waves.running:  # the wave goes on: each rank starts the next round
                self._start(r)

    def _describe(self) -> str:
        ranks = ", ".join(
            f"r{r}(wave={rk.waves.wave} running={rk.waves.running} steps={rk.waves.steps} "
            f"blocked={rk.blocked or '-'} started={rk.started} queue={dict(rk.queue)})"
            for r, rk in enumerate(self.ranks)
        )
        pending = {k: len(q) for k, q in self.channels.items() if q}
        return (
            f"{ranks}; coordinator(wave={self.coord.wave} running={self.coord.running}); "
            f"in flight={pending}; unfinished requests={sorted(self.sent - self.finished)}"
        )

    def _drain(self, pick) -> None:  # type: ignore[no-untyped-def]
        """Deliver and step until nothing can happen; fail if it never settles."""
        for _ in range(MAX_DRAIN_ACTIONS):
            actions = [("deliver", k) for k in self._deliverable()]
            actions += [("turn", r) for r in self._steppable()]
            if not actions:
                break
            what, arg = pick(actions)
            if what == "deliver":
                self._deliver(arg)
            else:
                self._turn(arg)
        else:
            raise AssertionError(
                f"no quiescence after {MAX_DRAIN_ACTIONS} actions (ranks keep stepping): {self._describe()}"
            )
        self._check_quiescent()

    def _check_quiescent(self) -> None:
        state = self._describe()
        blocked = [r for r, rk in enumerate(self.ranks) if rk.blocked]
        assert not blocked, f"deadlock: ranks {blocked} wait in the all-reduce, the rest are paused: {state}"
        assert all(not q for q in self.channels.values()), f"undelivered messages: {state}"
        assert self.sent == self.finished, f"stranded requests {sorted(self.sent - self.finished)}: {state}"
        assert all(not rk.waves.running for rk in self.ranks), f"idle ranks still running: {state}"
        waves = {rk.waves.wave for rk in self.ranks}
        assert len(waves) == 1, f"idle ranks disagree on the wave: {state}"
        assert self.coord.wave == waves.pop(), f"coordinator wave differs from the engines': {state}"
        assert not self.coord.running, f"coordinator thinks an idle cluster runs: {state}"

    # ---- rules -------------------------------------------------------------------------

    @precondition(lambda self: bool(self._deliverable()))
    @rule(data=st.data())
    def deliver_channel(self, data: st.DataObject) -> None:
        """Deliver everything one sender has in flight to one receiver, in order."""
        key = data.draw(st.sampled_from(self._deliverable()), label="channel")
        while key in self._deliverable():
            self._deliver(key)

    @precondition(lambda self: bool(self._steppable()))
    @rule()
    def every_rank_turns(self) -> None:
        """One loop turn of every rank that can step (a lockstep tick)."""
        for r in self._steppable():
            if r in self._steppable():
                self._turn(r)

    @rule(dt=st.sampled_from([0.0, 0.0625, 0.125, 1.0]))
    def coordinator_publishes(self, dt: float) -> None:
        self.clock += dt
        published = self._publish_snapshot()
        if dt >= self.coord.heartbeat_interval_s:
            assert published, "no heartbeat snapshot after a full heartbeat interval"

    @rule(seed=st.integers(0, 2**32 - 1), slow_share=st.sampled_from([0.0, 0.3, 0.6]))
    def drain_to_quiescence(self, seed: int, slow_share: float) -> None:
        """Run a random fair scheduler to quiescence, then check the idle-cluster invariants.

        A ``slow_share`` of the channels deliver only when nothing else can
        happen: long delays of one sender are what stale-wave races need.
        """
        rng = random.Random(seed)
        slow_keys = {k for k in self.channels if rng.random() < slow_share}

        def pick(actions: list[tuple[str, object]]) -> tuple[str, object]:
            fast = [a for a in actions if a[1] not in slow_keys]
            return rng.choice(fast or actions)

        self._drain(pick)

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def coordinator_and_client_waves_never_go_backwards(self) -> None:
        assert self.coord.wave >= self.seen_coord_wave, (
            f"coordinator wave went back from {self.seen_coord_wave} to {self.coord.wave}"
        )
        self.seen_coord_wave = self.coord.wave
        for c, client in enumerate(self.clients):
            assert client.wave >= self.seen_client_waves[c], (
                f"client {c} snapshot wave went back from {self.seen_client_waves[c]} to {client.wave}"
            )
            self.seen_client_waves[c] = client.wave

    @invariant()
    def no_rank_stuck_in_collective(self) -> None:
        """With nothing in flight, a rank in the all-reduce means a paused peer never joins."""
        if any(self.channels.values()) or not any(rk.blocked for rk in self.ranks):
            return
        idle = [r for r, rk in enumerate(self.ranks) if not rk.blocked and r not in self._steppable()]
        assert not idle, f"ranks {idle} paused while others wait in the all-reduce: {self._describe()}"

    @invariant()
    def requests_are_accounted_for(self) -> None:
        queued = {rid for rk in self.ranks for rid in rk.queue}
        assert queued <= self.sent - self.finished
        assert self.finished <= self.sent

    def teardown(self) -> None:
        # Skip when a rule already failed: let that failure be the one reported.
        if not self.ranks or sys.exc_info()[1] is not None:
            return
        # Round-robin fair scheduler: deliver everything readable, then one turn per rank.
        for _ in range(MAX_DRAIN_ACTIONS):
            keys = self._deliverable()
            steppable = self._steppable()
            if not keys and not steppable:
                break
            for key in keys:
                while self._readable(key):
                    self._deliver(key)
            for r in steppable:
                if not self.ranks[r].blocked and self.ranks[r].waves.should_step(bool(self.ranks[r].queue)):
                    self._turn(r)
        else:
            raise AssertionError(f"no quiescence in teardown: {self._describe()}")
        self._check_quiescent()


STATEFUL_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.timeout(120)
def test_waves_stateful() -> None:
    run_state_machine_as_test(WaveSystem, settings=STATEFUL_SETTINGS)


# ---- deterministic scenarios the random search must also cover ----------------------------


def _system(n_ranks: int = 2, interval: int = 2, ignore_excluded: bool = False, n_clients: int = 1) -> WaveSystem:
    s = WaveSystem()
    s.setup(n_ranks=n_ranks, n_clients=n_clients, interval=interval, ignore_excluded=ignore_excluded)
    return s


def _run_holding_back(s: WaveSystem, held: Key) -> None:
    """Deliver and step (first action first) until only the ``held`` channel could move."""
    for _ in range(MAX_DRAIN_ACTIONS):
        keys = [k for k in s._deliverable() if k != held]
        if keys:
            s._deliver(keys[0])
        elif s._steppable():
            s._turn(s._steppable()[0])
        else:
            return
    raise AssertionError(f"no progress: {s._describe()}")


def _deliver_all(s: WaveSystem, kind: str) -> None:
    for key in list(s.channels):
        if key[0] == kind:
            while s.channels[key]:
                s._deliver(key)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ignore_excluded", [False, True])
def test_cold_start_with_requests_to_one_rank(ignore_excluded: bool) -> None:
    s = _system(n_ranks=3, ignore_excluded=ignore_excluded)
    for _ in range(3):
        s.client_sends_request(_FixedData([0, 1, 2]))
    # The first request tells the coordinator; the next ones see running=True locally.
    assert [coordinator_decoder(b) for b in s.channels[("c2coord", 0)]] == [FirstRequest(rank=1, wave=0)]
    _deliver_all(s, "req")
    assert s._steppable() == [1]  # only the target has work; the others wait for the broadcast
    for _ in range(4):  # interval 2: it starts round 0 at step 2, and would collect it from step 4 on
        s._turn(1)
    # Round 0 has not arrived (the others have not started it): rank 1 does not wait in it,
    # it has simply nothing to do until they do.
    assert not s.ranks[1].blocked and s.ranks[1].waves.pending and s._spinning(s.ranks[1])
    _deliver_all(s, "c2coord")
    assert [engine_broadcast_decoder(b) for b in s.channels[("bcast", 0)]] == [StartDPWave(wave=0, exclude=1)]
    s._drain(lambda actions: actions[0])
    assert s.coord.wave == 1 and all(rk.waves.wave == 1 for rk in s.ranks)


@pytest.mark.timeout(60)
def test_stale_request_to_paused_cluster_restarts_everyone() -> None:
    s = _system(n_ranks=2)
    s.client_sends_request(_FixedData([0, 0, 1]))
    s._drain(lambda actions: actions[0])  # wave 0 runs and completes
    assert s.coord.wave == 1
    # The client never saw a snapshot: it still believes wave 0 is running.
    s.client_sends_request(_FixedData([0, 1, 1]))
    assert not s.channels[("c2coord", 0)]
    _deliver_all(s, "req")
    assert [coordinator_decoder(b) for b in s.channels[("e2coord", 1)]] == [StartWave(rank=1, wave=1)]
    _deliver_all(s, "e2coord")
    assert [engine_broadcast_decoder(b) for b in s.channels[("bcast", 0)]] == [StartDPWave(wave=1, exclude=1)]
    s._drain(lambda actions: actions[-1])
    assert s.coord.wave == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ignore_excluded", [False, True])
def test_first_request_arriving_after_its_wave_ended_wakes_every_rank(ignore_excluded: bool) -> None:
    s = _system(n_ranks=3, n_clients=2, ignore_excluded=ignore_excluded)
    s.client_sends_request(_FixedData([0, 0, 1]))  # FirstRequest(0, 0)
    s.client_sends_request(_FixedData([1, 1, 1]))  # FirstRequest(1, 0), held back below
    # Client 0's FirstRequest starts wave 0; client 1's request reaches rank 1 and
    # is served in that wave, which then ends, all before client 1's FirstRequest lands.
    _run_holding_back(s, ("c2coord", 1))
    assert s.finished == {"req-0", "req-1"}
    assert (s.coord.wave, s.coord.running) == (1, False)
    assert all(rk.waves.wave == 1 and not rk.waves.running for rk in s.ranks)
    _deliver_all(s, "c2coord")
    # The FirstRequest is stale now: rank 1 has no work left, so nobody may be excluded.
    broadcasts = [engine_broadcast_decoder(b) for b in s.channels[("bcast", 1)]]
    assert broadcasts == [StartDPWave(wave=1, exclude=-1)]
    s._drain(lambda actions: actions[0])
    assert s.coord.wave == 2


class _FixedData:
    """Stands in for ``st.data()`` in direct rule calls: returns fixed values in order."""

    def __init__(self, values: list[int]) -> None:
        self._values = list(values)

    def draw(self, strategy: object, label: str | None = None) -> int:
        del strategy, label
        return self._values.pop(0)
