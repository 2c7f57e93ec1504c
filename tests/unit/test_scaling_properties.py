"""Property tests of elastic scaling: the coordinator, clients following it, and the lockstep hold.

Two stateful models, both over the real pure logic:

* :class:`ScalingSystem`: the real scale sequence (:class:`~raydp.orchestration.scaling.ScaleChange`,
  step by step, over the in-memory runtime of ``orchestration_model``) growing and
  shrinking the cluster, deaths and restarts, engine stats, and clients
  that route with a :class:`~raydp.client.balancer.LoadBalancer` fed by the
  coordinator's snapshots through :func:`~raydp.client.membership.membership`
  (snapshots may arrive late or be dropped, as on PUB/SUB);
* :class:`HoldSystem`: lockstep ranks (:class:`~raydp.engine.lockstep.LockstepRank`
  over :class:`~raydp.engine.waves.EngineWaves`), the coordinator and clients on
  FIFO channels (as in ``test_waves_stateful.py``), with the launcher's real
  :class:`~raydp.orchestration.scaling.HoldSteps` holding, regrouping and releasing
  the gang at a random moment.
"""

from __future__ import annotations

import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from raydp.client.balancer import LoadBalancer
from raydp.client.membership import membership
from raydp.coordinator.state import CoordinatorState
from raydp.engine.lockstep import LockstepRank
from raydp.engine.waves import EngineWaves
from raydp.errors import ConfigError
from raydp.orchestration.scaling import HoldSteps, ScaleChange
from raydp.wire.codec import encode
from raydp.wire.control import (
    EngineDead,
    EngineRevived,
    EngineStats,
    FirstRequest,
    Regroup,
    StatsSnapshot,
    WaveComplete,
    coordinator_decoder,
    engine_broadcast_decoder,
    snapshot_decoder,
)
from raydp.wire.endpoints import EngineEndpoint
from raydp.wire.protocol import Request, RequestType, decode_input
from tests.unit.lockstep_model import Key, LockstepModel
from tests.unit.orchestration_model import ModelCoordinator, ModelRuntime, engines_of, started, status_of

pytestmark = pytest.mark.timeout(120)

MAX_RANKS = 6
STATEFUL_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _routes_beyond(body: bytes, size: int) -> bool:
    """Whether an encoded snapshot would have a client route to more than ``size`` ranks."""
    snap = snapshot_decoder(body)
    return (len(snap.counts) if snap.size == -1 else snap.size) > size


def _addr(rank: int, gen: int) -> list[str]:
    return [f"tcp://10.0.0.{rank}:{7000 + gen}"]


# ==== scale up/down, liveness and routing ==================================================


@dataclass
class ScaleClient:
    lb: LoadBalancer
    known: list[EngineEndpoint]
    inbox: deque[bytes] = field(default_factory=deque)  # the stats SUB: in order, may drop
    seq: int = 0
    dead: set[int] = field(default_factory=set)
    wave: int = 0
    in_flight: list[int] = field(default_factory=list)  # ranks of this client's unfinished requests


class ScalingSystem(RuleBasedStateMachine):
    """A launcher scaling 1-6 ranks, one coordinator, 1-2 clients following its snapshots."""

    def __init__(self) -> None:
        super().__init__()
        self.coord = CoordinatorState(engine_count=1)
        self.clients: list[ScaleClient] = []
        self.clock = 0.0
        self.size = 1  # the launcher's view: ranks routed to, ranks that exist
        self.engine_count = 1
        self.phase = "idle"  # idle | growing | shrinking
        self.target = 1
        self.joining: set[int] = set()
        self.gen = 0
        self.last_seq = 0
        self.seen_coord_wave = 0
        self.seen_state_wave = 0
        self.runtime = ModelRuntime(lambda: self.coord)
        self.change: ScaleChange | None = None

    @initialize(n=st.integers(1, 4), n_clients=st.integers(1, 2))
    def setup(self, n: int, n_clients: int) -> None:
        self.coord = CoordinatorState(engine_count=n, stats_interval_s=0.125, heartbeat_interval_s=1.0)
        self.orchestrator = started(
            n, self.runtime, ModelCoordinator(lambda body: self.coord.handle(coordinator_decoder(body)))
        )
        self.size = self.engine_count = self.target = n
        launch = engines_of(self.orchestrator)
        self.clients = [ScaleClient(LoadBalancer(n), list(launch)) for _ in range(n_clients)]

    def _handle(self, msg: Any) -> None:
        self.coord.handle(coordinator_decoder(encode(msg)))

    # ---- the launcher ----------------------------------------------------------------

    @precondition(lambda self: self.phase == "idle" and self.size < MAX_RANKS)
    @rule(k=st.integers(1, 2))
    def grow(self, k: int) -> None:
        self.target = min(MAX_RANKS, self.size + k)
        self.change = change = ScaleChange(self.orchestrator.controls, self.target, drain_timeout_s=5)
        change.build_new_ranks()
        change.track_new_ranks()  # track the new ranks; route to the old
        change.join_new_ranks()
        self.engine_count = self.target
        self.joining = set(range(self.size, self.target))
        self.phase = "growing"

    @precondition(lambda self: self.phase == "growing" and bool(self.joining))
    @rule(data=st.data())
    def a_new_rank_joins(self, data: st.DataObject) -> None:
        rank = data.draw(st.sampled_from(sorted(self.joining)), label="joining rank")
        self.joining.discard(rank)
        assert self.change is not None
        self.change.announce(rank)

    @precondition(lambda self: self.phase == "growing" and not self.joining)
    @rule()
    def finish_grow(self) -> None:
        assert self.change is not None
        self.change.open_new_ranks()
        self.size = self.target
        self.phase = "idle"

    @precondition(lambda self: self.phase == "idle" and self.size > 1)
    @rule(k=st.integers(1, 2))
    def shrink(self, k: int) -> None:
        self.target = max(1, self.size - k)
        self.change = ScaleChange(self.orchestrator.controls, self.target, drain_timeout_s=5)
        self.change.close_routing()  # the highest ranks drain
        self.size = self.target
        self.phase = "shrinking"

    # The launcher drains for a few stats intervals (``Scaler._drain`` settles for two), so
    # that clients in other processes have seen the new size before the ranks go: modelled
    # as "every client has", and no snapshot from before the shrink is still on its way to
    # one (PUB/SUB delivers in order within the settle time, or drops).
    @precondition(
        lambda self: (
            self.phase == "shrinking"
            and all(
                c.lb.size <= self.target and not any(_routes_beyond(body, self.target) for body in c.inbox)
                for c in self.clients
            )
        )
    )
    @rule()
    def finish_shrink(self) -> None:
        assert self.change is not None
        self.change.drop_ranks()  # what its drain waited for is the precondition
        self.engine_count = self.target
        self.phase = "idle"

    # ---- liveness, load, waves -------------------------------------------------------

    @rule(rank=st.integers(0, MAX_RANKS))
    def engine_dies(self, rank: int) -> None:
        self._handle(EngineDead(rank, "killed"))

    @rule(rank=st.integers(0, MAX_RANKS))
    def engine_restarts(self, rank: int) -> None:
        if rank in self.joining:
            return  # not started yet: nothing to restart
        self.gen += 1
        self._handle(EngineRevived(rank, _addr(rank, self.gen), f"node{rank}"))

    @rule(rank=st.integers(0, MAX_RANKS), waiting=st.integers(0, 3), running=st.integers(0, 3))
    def engine_reports(self, rank: int, waiting: int, running: int) -> None:
        self._handle(EngineStats(rank, waiting, running))

    @precondition(lambda self: self.coord.running)
    @rule()
    def wave_completes(self) -> None:
        self._handle(WaveComplete(0, self.coord.wave))

    # ---- publishing and clients --------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.125, 1.0]))
    def coordinator_publishes(self, dt: float) -> None:
        self.clock += dt
        snap = self.coord.due_snapshot(self.clock)
        if snap is None:
            return
        n = self.coord.engine_count
        assert len(snap.counts) == n, f"snapshot lists {len(snap.counts)} ranks of {n}"
        assert 1 <= snap.size <= n, f"snapshot size {snap.size} with {n} ranks"
        for name, table in (("dead", snap.dead), ("moved", snap.moved), ("nodes", snap.nodes)):
            assert all(0 <= r < n for r in table), f"snapshot {name} names a rank outside [0, {n}): {table}"
        assert snap.seq > self.last_seq, f"snapshot seq {snap.seq} after {self.last_seq}"
        self.last_seq = snap.seq
        body = encode(snap)
        for client in self.clients:
            client.inbox.append(body)

    @precondition(lambda self: any(c.inbox for c in self.clients))
    @rule(data=st.data(), drop=st.booleans())
    def client_reads_a_snapshot(self, data: st.DataObject, drop: bool) -> None:
        c = data.draw(st.sampled_from([i for i, cl in enumerate(self.clients) if cl.inbox]), label="client")
        client = self.clients[c]
        snap = snapshot_decoder(client.inbox.popleft())
        if drop:
            return  # PUB/SUB dropped it
        assert snap.seq > client.seq
        client.seq = snap.seq
        self._follow(client, snap)

    def _follow(self, client: ScaleClient, snap: StatsSnapshot) -> None:
        """What ``Client._on_snapshot`` does with the pure parts."""
        engines, size = membership(client.known, snap)
        assert [e.rank for e in engines] == list(range(len(engines))), "ranks must stay dense"
        assert 1 <= size <= max(1, len(engines))
        if len(engines) != len(client.known) or size != client.lb.size:
            client.lb.resize(len(engines), size)
            client.known = engines
            client.in_flight = [r for r in client.in_flight if r < len(engines)]  # ScaleDownError
        client.lb.on_snapshot(snap)
        assert client.lb.wave >= client.wave, f"client wave went back from {client.wave} to {client.lb.wave}"
        client.wave = client.lb.wave
        client.dead = set(snap.dead)

    @rule(data=st.data())
    def client_sends(self, data: st.DataObject) -> None:
        c = data.draw(st.integers(0, len(self.clients) - 1), label="client")
        client = self.clients[c]
        lb = client.lb
        try:
            rank = lb.choose(dead=client.dead)
        except ConfigError:
            assert all(r in client.dead for r in lb.eligible), "refused to send with a live rank to send to"
            return
        assert rank < lb.size, f"routed to rank {rank}, beyond the client's size {lb.size}"
        assert rank < len(client.known), f"routed to rank {rank} whose address the client does not know"
        assert rank < self.coord.engine_count, (
            f"routed to removed rank {rank}: the coordinator has {self.coord.engine_count} ranks"
        )
        assert rank < self.size or self.phase == "shrinking", (
            f"routed to rank {rank}, which the launcher has not opened (size {self.size}, {self.phase})"
        )
        assert rank not in client.dead
        lb.on_sent(rank)
        client.in_flight.append(rank)
        if lb.note_first_request():
            self._handle(FirstRequest(rank, lb.wave))

    @precondition(lambda self: any(c.in_flight for c in self.clients))
    @rule(data=st.data())
    def a_request_finishes(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from([i for i, cl in enumerate(self.clients) if cl.in_flight]), label="client")
        client = self.clients[c]
        i = data.draw(st.integers(0, len(client.in_flight) - 1), label="request")
        client.lb.on_finished(client.in_flight.pop(i))

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def coordinator_tracks_the_launchers_ranks(self) -> None:
        coord = self.coord
        n = coord.engine_count
        assert n == self.engine_count, f"coordinator has {n} ranks, the launcher {self.engine_count}"
        assert coord.size == self.size, f"coordinator routes to {coord.size}, the launcher to {self.size}"
        assert 1 <= coord.size <= n
        assert len(coord.counts) == len(coord.deaths) == len(coord.restarts) == n
        for name, table in (("dead", coord.dead), ("moved", coord.moved), ("nodes", coord.nodes)):
            assert all(0 <= r < n for r in table), f"{name} names a rank outside [0, {n}): {table}"

    @invariant()
    def the_orchestrator_owns_exactly_the_running_ranks(self) -> None:
        o, rt = self.orchestrator, self.runtime
        assert len(o.table) == self.engine_count, f"rank table {len(o.table)}, launcher {self.engine_count}"
        assert rt.alive == set(range(len(o.table))), f"engines running {sorted(rt.alive)}, table {len(o.table)}"
        assert rt.watched <= rt.alive, f"watching {sorted(rt.watched)} of running {sorted(rt.alive)}"
        if self.phase == "idle":
            assert rt.watched == rt.alive, f"idle, watching {sorted(rt.watched)} of {sorted(rt.alive)}"
            assert [e.rank for e in engines_of(o)] == list(range(self.size)), "endpoints name the ranks"
            assert o.endpoints is not None and o.endpoints.capacity == 256 * self.size

    @invariant()
    def waves_never_go_backwards(self) -> None:
        assert self.coord.wave >= self.seen_coord_wave
        self.seen_coord_wave = self.coord.wave
        state = self.orchestrator.state
        assert state.wave >= self.seen_state_wave, f"the state's wave went back to {state.wave}"
        self.seen_state_wave = state.wave

    @invariant()
    def the_cluster_state_holds_its_invariants(self) -> None:
        state = self.orchestrator.state
        state.check()
        if self.phase == "idle":
            assert state.dp_size == len(state.table) == self.size, f"idle: dp_size {state.dp_size}, {self.size}"
            assert state.joining == 0

    @invariant()
    def clients_route_within_their_view(self) -> None:
        for client in self.clients:
            lb = client.lb
            assert lb.engine_count == len(client.known)
            assert all(r < lb.size for r in lb.eligible), f"eligible {lb.eligible} beyond size {lb.size}"


def test_scaling_stateful() -> None:
    run_state_machine_as_test(ScalingSystem, settings=STATEFUL_SETTINGS)


# ==== the lockstep hold ==========================================================================

MAX_DRAIN_ACTIONS = 5_000
Flags = tuple[bool, bool, int]  # what a rank contributes to a round: unfinished, held, pace


class FakeGroup:
    """One rank's handle on a DP group in one process; the model resolves its all-reduces.

    Non-blocking rounds are shared by every member (``rounds``: round -> rank
    -> flags): ``start`` contributes to the next one, ``collect`` reads the
    MAX of the last one once every member contributed. The confirming
    ``sync`` is a barrier the model resolves, handing out ``result``.
    """

    def __init__(self, master: str, rank: int, rounds: dict[int, dict[int, Flags]], members: Callable[[], int]) -> None:
        self.master = master
        self.group = master
        self.rank, self.rounds, self.started, self.members = rank, rounds, 0, members
        self.result: tuple[bool, bool] | None = None
        self.closed = False
        self.last_pace = 0

    def sync(self, unfinished: bool, hold: bool) -> tuple[bool, bool]:
        assert not self.closed, "all-reduce on a closed group"
        assert self.result is not None, "sync called before every rank joined the all-reduce"
        result, self.result = self.result, None
        return result

    def start(self, unfinished: bool, hold: bool, pace: int = 0) -> None:
        assert not self.closed, "all-reduce on a closed group"
        self.rounds.setdefault(self.started, {})[self.rank] = (unfinished, hold, pace)
        self.started += 1

    def last_round(self) -> dict[int, Flags]:
        return self.rounds.get(self.started - 1, {})

    def arrived(self) -> bool:
        return len(self.last_round()) == self.members()

    def collect(self) -> tuple[bool, bool]:
        found = self.last_round()
        assert found and all(self.rounds.get(self.started - 1, {}).get(r) is not None for r in found)
        self.last_pace = max(p for _, _, p in found.values())
        return max(u for u, _, _ in found.values()), max(h for _, h, _ in found.values())

    def close(self) -> None:
        self.closed = True


@dataclass
class LRank:
    lockstep: LockstepRank
    queue: dict[str, int] = field(default_factory=dict)  # request id -> steps of work left
    blocked: str = ""  # "confirm" (in the barrier); "" runs
    unfinished: bool = False
    last_stats: tuple[int, int] = (0, 0)

    @property
    def waves(self) -> EngineWaves:
        return self.lockstep.waves


class HoldSystem(LockstepModel):
    """2-3 lockstep ranks, a coordinator, 1-2 clients, and a launcher that re-forms the DP group."""

    ranks: list[LRank]
    max_work = 3

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self.launcher = "idle"  # idle | holding | regrouping
        self.hold: HoldSteps | None = None
        self.groups: dict[str, dict[int, dict[int, Flags]]] = {}  # master -> its rounds

    def _group(self, master: str, rank: int) -> FakeGroup:
        return FakeGroup(master, rank, self.groups.setdefault(master, {}), lambda: len(self.ranks))

    @initialize(n_ranks=st.integers(2, 3), n_clients=st.integers(1, 2), interval=st.integers(1, 3))
    def setup(self, n_ranks: int, n_clients: int, interval: int) -> None:
        self._open(n_ranks, n_clients, launcher=True)
        self.ranks = []
        for r in range(n_ranks):

            def send(msg: Any, r: int = r) -> None:
                self._push(("e2coord", r), encode(msg))

            def join(msg: Regroup, r: int = r) -> FakeGroup:
                return self._group(msg.dp_master, r)

            waves = EngineWaves(rank=r, interval=interval)
            # Paced by the model's clock (coordinator ticks): the agreed pace varies with it.
            self.ranks.append(
                LRank(
                    LockstepRank(
                        r, waves, self._group("m0", r), send, join, min_interval_s=0.125, clock=lambda: self.clock
                    )
                )
            )

    # ---- what a rank does ------------------------------------------------------------------

    def _can_step(self, r: int) -> bool:
        rk = self.ranks[r]
        return rk.lockstep.should_step(bool(rk.queue)) and not self._spinning(rk)

    def _on_request(self, r: int, req: Request) -> None:
        rk = self.ranks[r]
        rk.lockstep.on_request(req.wave)
        rk.queue[req.request_id] = req.max_tokens
        rk.lockstep.tick()

    def _on_broadcast(self, r: int, body: bytes) -> None:
        rk = self.ranks[r]
        rk.lockstep.on_broadcast(engine_broadcast_decoder(body))
        rk.lockstep.tick()

    def _turn(self, r: int) -> None:
        rk = self.ranks[r]
        phase = self.coord.hold_phase()
        assert phase not in ("frozen", "regrouping"), f"rank {r} steps while the gang is {phase}: {self._describe()}"
        self._work(r)
        if self._collects_now(rk):
            unfinished, hold = rk.lockstep.collective.collect()  # type: ignore[union-attr]
            if hold or not unfinished:  # it confirms: the barrier, once every rank is in it
                rk.blocked, rk.unfinished = "confirm", bool(rk.queue)
                self._resolve_collective()
                return
        rk.lockstep.after_step(bool(rk.queue))  # never blocks: collecting a round that arrived, or not

    def _collects_now(self, rk: LRank) -> bool:
        """Whether this step collects the round in flight: an interval old, and every member started it."""
        w, group = rk.waves, rk.lockstep.collective
        return (
            w.pending
            and w.steps + 1 - w.started_at >= max(w.interval, w.due)
            and isinstance(group, FakeGroup)
            and group.arrived()
        )

    def _spinning(self, rk: LRank) -> bool:
        """Nothing to do but wait for a round a peer has not started: dummy steps that change
        nothing, which the model does not take (they could starve the peer); one left spinning
        at quiescence still fails the check that idle ranks do not run."""
        w = rk.waves
        due = w.pending and w.steps + 1 - w.started_at >= max(w.interval, w.due)
        return not rk.queue and due and not self._collects_now(rk)

    def _resolve_collective(self) -> None:
        if not all(rk.blocked == "confirm" for rk in self.ranks):
            return
        masters = {rk.lockstep.collective.master for rk in self.ranks if rk.lockstep.collective is not None}
        assert len(masters) == 1 and all(rk.lockstep.collective is not None for rk in self.ranks), (
            f"an all-reduce across different DP groups {masters}: {self._describe()}"
        )
        result = (max(rk.unfinished for rk in self.ranks), max(rk.waves.held for rk in self.ranks))
        waves = set()
        for rk in self.ranks:
            group = rk.lockstep.collective
            assert isinstance(group, FakeGroup)
            group.result = result
            rk.blocked = ""
            rk.lockstep.after_step(rk.unfinished)
            waves.add(rk.waves.position())
        assert len(waves) == 1, f"ranks disagree after one all-reduce: {waves}: {self._describe()}"

    def _tick_coordinator(self, dt: float) -> None:
        self.clock += dt
        for msg in self.coord.due_broadcasts(self.clock):
            self._broadcast(msg)
        self._publish_snapshot()

    def _describe(self) -> str:
        ranks = ", ".join(
            f"r{r}(wave={rk.waves.wave} running={rk.waves.running} held={rk.waves.held} steps={rk.waves.steps} "
            f"blocked={rk.blocked} queue={dict(rk.queue)} group={getattr(rk.lockstep.collective, 'master', None)})"
            for r, rk in enumerate(self.ranks)
        )
        pending = {
            k: [f"{len(q)} x {self._peek(k, q[0])!r} .. {self._peek(k, q[-1])!r}"]
            for k, q in self.channels.items()
            if q
        }
        hold = self.coord.hold
        return (
            f"{ranks}; coordinator(wave={self.coord.wave} running={self.coord.running} "
            f"hold={self.coord.hold_phase()} acks={hold.acks if hold else None} "
            f"woke={hold.woke_wave if hold else None} deferred={hold.deferred_start if hold else None}); "
            f"launcher={self.launcher}; in flight={pending}; unfinished={sorted(self.sent - self.finished)}"
        )

    @staticmethod
    def _peek(key: Key, body: bytes) -> object:
        if key[0] == "req":
            return decode_input(RequestType.ADD.value, body)
        if key[0] == "bcast":
            return engine_broadcast_decoder(body)
        if key[0] == "snap":
            return "snapshot"
        return coordinator_decoder(body)

    # ---- the launcher ------------------------------------------------------------------------

    def _launcher_can_act(self) -> bool:
        state = status_of(self.coord)
        return (self.launcher == "holding" and HoldSteps.frozen(state)) or (
            self.launcher == "regrouping" and HoldSteps.regrouped(state)
        )

    def _launcher_acts(self) -> None:
        state = status_of(self.coord)
        assert self.hold is not None
        if self.launcher == "holding" and HoldSteps.frozen(state):
            self._check_frozen()
            self.hold.regroup(len(self.ranks), f"m{self.epoch}")
            self.launcher = "regrouping"
        elif self.launcher == "regrouping" and HoldSteps.regrouped(state):
            assert all(
                rk.lockstep.collective is not None and rk.lockstep.collective.master == f"m{self.epoch}"
                for rk in self.ranks
            ), f"regrouped, but not every rank is in the new group: {self._describe()}"
            self.hold.release()
            self.launcher = "idle"

    def _check_frozen(self) -> None:
        state = self._describe()
        assert not any(rk.blocked for rk in self.ranks), f"frozen with a rank in the all-reduce: {state}"
        assert not any(rk.waves.running for rk in self.ranks), f"frozen with a rank running: {state}"
        assert len({rk.waves.wave for rk in self.ranks}) == 1, f"frozen in different waves: {state}"

    @precondition(lambda self: self.launcher == "idle" and self.epoch < 3)
    @rule()
    def launcher_holds(self) -> None:
        self.epoch += 1
        control = ModelCoordinator(lambda body: self._push(("l2coord",), body))
        self.hold = HoldSteps(control, len(self.ranks))
        self.hold.hold()
        self.launcher = "holding"

    @precondition(lambda self: self._launcher_can_act())
    @rule()
    def launcher_advances(self) -> None:
        self._launcher_acts()

    # ---- clients, delivery, turns --------------------------------------------------------------

    @rule(dt=st.sampled_from([0.125, 1.0]))
    def coordinator_tick(self, dt: float) -> None:
        self._tick_coordinator(dt)

    @rule(seed=st.integers(0, 2**32 - 1))
    def run_a_while(self, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(rng.randint(1, 30)):
            actions = [("deliver", k) for k in self._deliverable()] + [("turn", r) for r in self._steppable()]
            if not actions:
                return
            what, arg = rng.choice(actions)
            if what == "deliver":
                self._deliver(arg)
            else:
                self._turn(arg)

    # ---- invariants -----------------------------------------------------------------------------

    @invariant()
    def frozen_means_nobody_steps(self) -> None:
        if self.coord.hold_phase() == "frozen":
            self._check_frozen()

    def teardown(self) -> None:
        if not self.ranks or sys.exc_info()[1] is not None:
            return
        # A fair scheduler: deliver everything readable, one turn per rank, the launcher's next
        # step, and the coordinator's heartbeat when nothing else can happen.
        idle_beats = beats = 0
        for _ in range(MAX_DRAIN_ACTIONS):
            for key in self.channels:
                if key[0] == "snap":  # heartbeats go on forever: not progress
                    while self.channels[key]:
                        self._deliver(key)
            keys, steppable = self._deliverable(), self._steppable()
            if (keys or steppable or self._launcher_can_act()) and beats < 20:
                idle_beats = 0
                for key in keys:
                    while key in self._deliverable():
                        self._deliver(key)
                for r in steppable:
                    if r in self._steppable():
                        self._turn(r)
                if self._launcher_can_act():
                    self._launcher_acts()
                continue
            if idle_beats >= 3:
                break
            idle_beats += 1
            beats += 1  # the coordinator repeats Hold and waves forever: bound the heartbeats
            self._tick_coordinator(1.0)
        else:
            raise AssertionError(f"no quiescence: {self._describe()}")
        state = self._describe()
        assert self.launcher == "idle", f"the launcher waits forever for the hold (stuck {self.launcher}): {state}"
        assert not any(rk.blocked for rk in self.ranks), f"deadlock in the all-reduce: {state}"
        assert self.sent == self.finished, f"requests never finish after release: {state}"
        assert not any(rk.waves.running or rk.waves.held for rk in self.ranks), f"ranks still running/held: {state}"
        assert len({rk.waves.wave for rk in self.ranks}) == 1, f"ranks disagree on the wave: {state}"
        assert self.coord.hold is None and not self.coord.running, f"coordinator not idle: {state}"
        assert self.coord.wave == self.ranks[0].waves.wave, f"coordinator wave differs: {state}"


HOLD_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_hold_stateful() -> None:
    run_state_machine_as_test(HoldSystem, settings=HOLD_SETTINGS)


# ---- the races the random search found, pinned ---------------------------------------------------


class _FixedData:
    """Stands in for ``st.data()`` in direct rule calls: returns fixed values in order."""

    def __init__(self, values: list[int]) -> None:
        self._values = list(values)

    def draw(self, strategy: object, label: str | None = None) -> int:
        del strategy, label
        return self._values.pop(0)


def _hold_system(n_ranks: int = 2) -> HoldSystem:
    s = HoldSystem()
    s.setup(n_ranks=n_ranks, n_clients=1, interval=1)
    return s


def test_a_first_request_racing_the_hold_does_not_strand_its_target_in_the_all_reduce() -> None:
    s = _hold_system()
    s.launcher_holds()
    s.client_sends_request(_FixedData([0, 0, 1]))
    s._deliver(("l2coord",))  # HoldCluster: Hold goes out
    s._deliver(("req", 0, 0))  # rank 0 steps alone, not held yet ...
    s._turn(0)  # (interval 1: it starts round 0 ...
    s._turn(0)  # ... which is due at its next step, but has not arrived: rank 1 never started it)
    # It does not wait in the all-reduce (it would be unable to read the Hold): nothing to do but poll it.
    assert not s.ranks[0].blocked and s._spinning(s.ranks[0])
    s._deliver(("bcast", 1))
    s._deliver(("c2coord", 0))  # the FirstRequest reaches the coordinator during the hold
    assert [engine_broadcast_decoder(b) for b in s.channels[("bcast", 1)]], "the gang must be woken"
    s.teardown()  # the hold freezes, regroups and releases; the request finishes
    assert s.finished == {"req-0"} and s.launcher == "idle"


def test_a_rank_whose_wave_a_peers_hold_ended_waits_for_the_coordinator() -> None:
    s = _hold_system()
    s.launcher_holds()
    s._deliver(("l2coord",))
    s._deliver(("bcast", 1))  # only rank 1 is held
    s.client_sends_request(_FixedData([0, 0, 3]))
    s._deliver(("c2coord", 0))  # wakes the gang (not frozen yet)
    s._deliver(("req", 0, 0))
    s._deliver(("bcast", 1))
    s._turn(1)
    s._turn(0)  # both start round 0 (interval 1): rank 1 contributes its hold
    s._turn(1)  # rank 1 collects it (held: confirm) and waits in the barrier ...
    s._turn(0)  # ... and so does rank 0: the confirmation ends the wave; rank 0 still has work
    rank0 = s.ranks[0]
    assert not rank0.waves.held and rank0.queue and not rank0.waves.running
    assert 0 not in s._steppable(), "rank 0 would step alone into an all-reduce nobody joins"
    s.teardown()
    assert s.finished == {"req-0"} and s.launcher == "idle"
