"""A restarted coordinator: restored from its launcher, resynced from the engines, at its predecessor's addresses."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from raydp.coordinator.loop import CoordinatorLoop
from raydp.coordinator.resync import RESYNC_S, WITHHOLD_S, Restored
from raydp.coordinator.state import CoordinatorState
from raydp.wire.codec import encode
from raydp.wire.control import (
    BROADCAST_TOPIC,
    EngineReport,
    EngineStats,
    Resync,
    StartDPWave,
    StatsSnapshot,
    WaveComplete,
    engine_broadcast_decoder,
    presence_topic,
    snapshot_decoder,
)
from raydp.wire.endpoints import CoordinatorEndpoints
from raydp.wire.transport import SocketOptions

OPTS = SocketOptions(high_water_mark=1000, max_message_bytes=1 << 20)


def restored_state(now: float = 0.0, **kw: Any) -> CoordinatorState:
    state = CoordinatorState(3, stats_interval_s=0.1, heartbeat_interval_s=1.0)
    fields: dict[str, Any] = {
        "engine_count": 3,
        "size": 3,
        "dead": {2: "killed"},
        "deaths": [0, 1, 2],
        "restarts": [0, 1, 0],
        "moved": {1: ["ipc:///x/in"]},
        "nodes": {1: "node-b"},
    }
    state.restore(Restored(**{**fields, **kw}), now)
    return state


def report(rank: int, wave: int = 0, stepping: bool = False, load: tuple[int, int] = (0, 0)) -> EngineReport:
    return EngineReport(rank=rank, waiting=load[0], running=load[1], wave=wave, stepping=stepping)


# ---- the pure state ---------------------------------------------------------------------


def test_restore_keeps_the_launchers_knowledge_and_publishes_it() -> None:
    state = restored_state()
    state.handle(report(0))
    state.handle(report(1))
    snap = state.due_snapshot(0.01)
    assert snap is not None
    assert snap.dead == {2: "killed"} and snap.moved == {1: ["ipc:///x/in"]} and snap.nodes == {1: "node-b"}
    assert state.deaths == [0, 1, 2] and state.restarts == [0, 1, 0] and snap.size == 3
    assert snap.prefill_ranks == -1, "no P/D boundary was moved: clients keep their launch endpoints'"


def test_a_successor_publishes_the_p_d_boundary_the_launcher_moved_and_ignores_one_that_empties_a_pool() -> None:
    state = restored_state(prefill_ranks=2)
    state.handle(report(0))
    state.handle(report(1))  # a successor publishes once it heard the live ranks
    snap = state.due_snapshot(0.01)
    assert snap is not None and snap.prefill_ranks == 2
    assert restored_state(prefill_ranks=3).prefill_ranks == -1, "3 of 3 ranks prefilling leaves no decode rank"


def test_snapshots_wait_for_every_live_rank_or_the_withhold_deadline() -> None:
    state = restored_state()
    state.handle(report(0, load=(4, 1)))
    assert state.due_snapshot(0.2) is None  # rank 1 has not answered; rank 2 is dead and not awaited
    snap = state.due_snapshot(WITHHOLD_S + 0.01)
    assert snap is not None and snap.counts[0] == (4, 1)


def test_resync_is_repeated_for_silent_ranks_then_given_up() -> None:
    state = restored_state()
    asks = [t for t in (0.0, 0.05, 0.1, 0.25, 0.4) if any(isinstance(m, Resync) for m in state.due_broadcasts(t))]
    assert asks == [0.0, 0.1, 0.25, 0.4]
    assert not any(isinstance(m, Resync) for m in state.due_broadcasts(RESYNC_S + 1))
    state2 = restored_state()
    state2.handle(report(0))
    state2.handle(report(1))
    assert not any(isinstance(m, Resync) for m in state2.due_broadcasts(0.0))  # everyone answered


def test_a_stepping_rank_wakes_its_paused_peers_into_its_wave() -> None:
    state = restored_state()
    assert state.handle(report(0, wave=7)) is None  # paused, waiting for wave 7
    assert state.wave == 7 and not state.running
    wake = state.handle(report(1, wave=7, stepping=True))  # may already wait in the collective
    assert wake == StartDPWave(wave=7, exclude=1)
    assert state.running
    assert state.handle(report(0, wave=7)) is None  # a late report from a paused peer changes nothing
    assert state.wave == 7 and state.running


def test_waves_never_go_back_and_complete_normally_after_a_resync() -> None:
    state = restored_state()
    state.handle(report(0, wave=5))
    state.handle(report(1, wave=3))  # an older (impossible but harmless) position
    assert state.wave == 5
    state.handle(report(1, wave=5, stepping=True))
    state.handle(WaveComplete(rank=0, wave=5))
    assert state.wave == 6 and not state.running


def test_restore_clips_to_the_rank_count() -> None:
    state = restored_state(engine_count=2, size=5, dead={2: "killed", 7: "x"}, moved={4: ["ipc:///y"]})
    assert state.engine_count == 2 and state.size == 2 and state.dead == {} and state.moved == {}
    assert state.resync is not None and state.resync.awaiting == {0, 1}


def test_reports_for_unknown_ranks_are_dropped() -> None:
    state = restored_state()
    assert state.handle(report(9, stepping=True)) is None
    assert state.rejected == 1 and not state.running


# ---- a real successor at a killed predecessor's addresses -----------------------------------


def _serve_coordinator(prefix: str, conn: Any) -> None:
    """A coordinator in its own process, to be SIGKILLed: no teardown, no Shutdown broadcast."""
    loop = CoordinatorLoop(
        CoordinatorState(2, 0.02, 0.2), OPTS, transport="auto", node_id="n0", ip="127.0.0.1", ipc_prefix=prefix
    )
    conn.send(loop.endpoints)
    loop.run()


class Peers:
    """An engine (PUSH + SUB on the broadcast, presence topic) and a client SUB, as real peers connect them."""

    def __init__(self, endpoints: CoordinatorEndpoints, rank: int, over_tcp: bool) -> None:
        pick = 1 if over_tcp else 0
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(endpoints.collect[pick])
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, BROADCAST_TOPIC)
        self.sub.setsockopt(zmq.SUBSCRIBE, presence_topic(rank))
        self.sub.connect(endpoints.broadcast[pick])
        self.stats = self.ctx.socket(zmq.SUB)
        self.stats.setsockopt(zmq.SUBSCRIBE, b"")
        self.stats.connect(endpoints.publish[pick])

    def next_broadcast(self, kind: type, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sub.poll(50):
                msg = engine_broadcast_decoder(self.sub.recv_multipart()[1])
                if isinstance(msg, kind):
                    return msg
        raise AssertionError(f"no {kind.__name__} within {timeout_s}s")

    def snapshot_where(self, test: Any, timeout_s: float) -> StatsSnapshot:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.stats.poll(50):
                snap = snapshot_decoder(self.stats.recv())
                if test(snap):
                    return snap
        raise AssertionError(f"no matching snapshot within {timeout_s}s")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def predecessor() -> Iterator[tuple[CoordinatorEndpoints, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_coordinator, args=(f"test-resync-{uuid.uuid4().hex[:8]}", child), daemon=True)
    proc.start()
    assert parent.poll(60), "the coordinator process did not start"
    yield parent.recv(), proc
    if proc.is_alive():
        proc.kill()
    proc.join(10)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("over_tcp", [False, True], ids=["ipc", "tcp"])
def test_peers_reconnect_to_a_successor_bound_at_the_same_addresses(
    predecessor: tuple[CoordinatorEndpoints, Any], over_tcp: bool
) -> None:
    endpoints, proc = predecessor
    engines = [Peers(endpoints, rank, over_tcp) for rank in (0, 1)]
    successor: CoordinatorLoop | None = None
    try:
        engines[0].push.send(encode(EngineStats(rank=0, waiting=3, running=0)))
        engines[0].snapshot_where(lambda s: s.counts[0] == (3, 0), 10)  # the predecessor served them
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        state = CoordinatorState(2, 0.02, 0.2)
        state.restore(Restored(engine_count=2, size=2, dead={}, deaths=[0, 0], restarts=[0, 0]), time.monotonic())
        successor = CoordinatorLoop(state, OPTS, transport="auto", node_id="n0", ip="127.0.0.1", rebind=endpoints)
        assert successor.endpoints == endpoints
        threading.Thread(target=successor.run, daemon=True).start()
        assert successor.describe().resynced is False  # what operators and restart waits read
        for rank, peer in enumerate(engines):  # each engine hears Resync on the socket it already had
            peer.next_broadcast(Resync, 15)
            peer.push.send(encode(report(rank, wave=4, stepping=rank == 1, load=(rank + 1, 2))))
        snap = engines[0].snapshot_where(lambda s: s.counts == [(1, 2), (2, 2)], 15)
        assert successor.describe().resynced is True
        assert snap.wave == 4 and snap.running  # rank 1 was stepping wave 4
        assert engines[0].next_broadcast(StartDPWave, 5).wave == 4  # its paused peer is woken
        assert successor.wait_for_engines(2, 5)
    finally:
        if successor is not None:
            successor.close()
        for peer in engines:
            peer.close()
