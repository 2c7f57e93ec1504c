"""Elastic scaling in the pure modules: the coordinator's size, the balancer, membership, the gang hold."""

from __future__ import annotations

import logging

import pytest

from raydp.client.balancer import LoadBalancer
from raydp.client.membership import membership
from raydp.coordinator.state import CoordinatorState
from raydp.errors import ConfigError
from raydp.wire.control import (
    EngineDead,
    EngineRevived,
    EngineStats,
    FirstRequest,
    Hold,
    HoldAck,
    HoldCluster,
    Regroup,
    RegroupCluster,
    Regrouped,
    Release,
    ReleaseCluster,
    ScaleEngines,
    StartDPWave,
    StartWave,
    StatsSnapshot,
    WaveComplete,
)
from raydp.wire.endpoints import EngineEndpoint

pytestmark = pytest.mark.timeout(120)


def _state(engine_count: int = 2, wave: int = 0, running: bool = False) -> CoordinatorState:
    state = CoordinatorState(engine_count=engine_count, wave=wave, running=running, heartbeat_interval_s=1.0)
    state.changed = False
    return state


def _snap(state: CoordinatorState, now: float) -> StatsSnapshot:
    snap = state.due_snapshot(now)
    assert snap is not None
    return snap


# ---- CoordinatorState: ScaleEngines ----------------------------------------------------


def test_grow_adds_ranks_first_and_routes_to_them_only_on_the_second_message() -> None:
    state = _state(engine_count=2)
    state.handle(EngineStats(rank=1, waiting=1, running=2))
    assert state.handle(ScaleEngines(engine_count=4, size=2)) is None
    assert (state.engine_count, state.size) == (4, 2)
    assert state.counts == [[0, 0], [1, 2], [0, 0], [0, 0]]
    snap = _snap(state, 0.0)
    assert (len(snap.counts), snap.size) == (4, 2), "clients must not route to ranks still joining"
    state.handle(EngineStats(rank=3, waiting=0, running=1))  # a joining rank may report already
    assert state.counts[3] == [0, 1] and state.rejected == 0
    state.handle(ScaleEngines(engine_count=4, size=4))
    assert (state.engine_count, state.size) == (4, 4)
    assert _snap(state, 1.0).size == 4


def test_shrink_narrows_the_size_first_then_removes_the_ranks() -> None:
    state = _state(engine_count=4)
    state.handle(EngineStats(rank=3, waiting=2, running=1))
    state.handle(ScaleEngines(engine_count=4, size=2))
    assert (state.engine_count, state.size) == (4, 2)
    assert state.counts[3] == [2, 1], "a draining rank still reports its load"
    snap = _snap(state, 0.0)
    assert (len(snap.counts), snap.size) == (4, 2)
    state.handle(ScaleEngines(engine_count=2, size=2))
    assert (state.engine_count, state.size) == (2, 2)
    assert state.counts == [[0, 0], [0, 0]]
    assert len(_snap(state, 1.0).counts) == 2


def test_size_minus_one_means_every_rank() -> None:
    state = _state(engine_count=2)
    state.handle(ScaleEngines(engine_count=3))
    assert (state.engine_count, state.size) == (3, 3)


def test_removed_ranks_take_their_dead_moved_and_node_entries_with_them() -> None:
    state = _state(engine_count=4)
    state.handle(EngineRevived(rank=1, input_addresses=["tcp://10.0.0.1:1"], node_id="n1"))
    state.handle(EngineRevived(rank=2, input_addresses=["tcp://10.0.0.2:1"], node_id="n2"))
    state.handle(EngineRevived(rank=3, input_addresses=["tcp://10.0.0.3:1"], node_id="n3"))
    state.handle(EngineDead(rank=3, cause="killed"))
    state.handle(EngineDead(rank=0, cause="oom"))
    state.handle(ScaleEngines(engine_count=4, size=2))
    assert set(state.moved) == {1, 2, 3} and 3 in state.dead, "draining ranks keep their notices"
    state.handle(ScaleEngines(engine_count=2, size=2))
    assert state.dead == {0: "oom"}
    assert state.moved == {1: ["tcp://10.0.0.1:1"]}
    assert state.nodes == {1: "n1"}
    snap = _snap(state, 0.0)
    assert (snap.dead, snap.moved, snap.nodes) == ({0: "oom"}, {1: ["tcp://10.0.0.1:1"]}, {1: "n1"})
    assert (state.deaths, state.restarts) == ([1, 0], [0, 1])


def test_messages_of_a_removed_rank_are_dropped_and_counted() -> None:
    state = _state(engine_count=3)
    state.handle(ScaleEngines(engine_count=2, size=2))
    state.changed = False
    state.handle(EngineStats(rank=2, waiting=5, running=5))
    assert state.handle(FirstRequest(rank=2, wave=0)) is None
    state.handle(EngineDead(rank=2, cause="killed"))
    assert state.counts == [[0, 0], [0, 0]]
    assert (state.running, state.dead, state.rejected, state.changed) == (False, {}, 3, False)


@pytest.mark.parametrize(
    ("msg", "named"),
    [
        (ScaleEngines(engine_count=2, size=3), "engine_count=2, size=3"),
        (ScaleEngines(engine_count=3, size=0), "engine_count=3, size=0"),
        (ScaleEngines(engine_count=0), "engine_count=0, size=-1"),
        (ScaleEngines(engine_count=3, size=-5), "engine_count=3, size=-5"),
        (ScaleEngines(engine_count=-1, size=1), "engine_count=-1, size=1"),
        (ScaleEngines(engine_count=3, size=3, prefill=3), "engine_count=3, size=3, prefill=3"),
        (ScaleEngines(engine_count=3, size=2, prefill=0), "engine_count=3, size=2, prefill=0"),
    ],
)
def test_bad_scale_is_rejected_logged_and_changes_nothing(
    msg: ScaleEngines, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state(engine_count=3)
    state.handle(ScaleEngines(engine_count=3, size=2))
    state.handle(EngineStats(rank=2, waiting=1, running=1))
    state.changed = False
    with caplog.at_level(logging.WARNING, logger="raydp.coordinator"):
        assert state.handle(msg) is None
    assert (state.engine_count, state.size, state.rejected, state.changed) == (3, 2, 1, False)
    assert state.counts == [[0, 0], [0, 0], [1, 1]]
    assert f"ScaleEngines({named}" in caplog.text
    assert state.prefill_ranks == -1


def test_snapshot_carries_size_and_nodes() -> None:
    state = CoordinatorState(engine_count=2)
    state.handle(ScaleEngines(engine_count=3, size=2))
    state.handle(EngineRevived(rank=2, input_addresses=["tcp://10.0.0.9:5"], node_id="node-c"))
    snap = _snap(state, 0.0)
    assert snap == StatsSnapshot(
        counts=[(0, 0)] * 3,
        wave=0,
        running=False,
        seq=1,
        size=2,
        moved={2: ["tcp://10.0.0.9:5"]},
        nodes={2: "node-c"},
    )


def test_a_rank_joining_above_the_size_is_not_a_restart() -> None:
    state = _state(engine_count=2)
    state.handle(ScaleEngines(engine_count=3, size=2))
    state.handle(EngineRevived(rank=2, input_addresses=["ipc:///new"], node_id="n"))
    assert state.restarts == [0, 0, 0]
    state.handle(ScaleEngines(engine_count=3, size=3))
    state.handle(EngineRevived(rank=2, input_addresses=["ipc:///again"]))  # now it is one of the cluster
    assert state.restarts == [0, 0, 1]
    assert state.nodes == {2: "n"}, "a revival without a node keeps the known node"


def test_revived_without_node_records_none() -> None:
    state = _state(engine_count=2)
    state.handle(EngineRevived(rank=1, input_addresses=["ipc:///x"]))
    assert state.nodes == {} and state.moved == {1: ["ipc:///x"]}


def test_scale_keeps_the_wave_and_publishes() -> None:
    state = _state(engine_count=2, wave=5, running=True)
    state.handle(ScaleEngines(engine_count=4, size=2))
    assert (state.wave, state.running, state.changed) == (5, True, True)


# ---- LoadBalancer.resize ----------------------------------------------------------------


def test_resize_routes_only_below_the_size() -> None:
    lb = LoadBalancer(2)
    lb.resize(4, 2)
    lb.on_snapshot(StatsSnapshot(counts=[(9, 0), (9, 0), (0, 0), (0, 0)], wave=0, running=False, size=2))
    for _ in range(10):
        rank = lb.choose()
        assert rank < 2, f"chose rank {rank}, still joining"
        lb.on_sent(rank)
    lb.resize(4, 4)
    assert lb.choose() in (2, 3)


def test_shrink_keeps_the_in_flight_counts_of_draining_ranks() -> None:
    lb = LoadBalancer(4)
    for rank in (3, 3, 2, 0):
        lb.on_sent(rank)
    lb.resize(4, 2)
    assert [lb.in_flight(r) for r in range(4)] == [1, 0, 1, 2]
    picks = {lb.choose() for _ in range(5)}
    assert picks <= {0, 1}
    lb.on_finished(3)
    assert lb.in_flight(3) == 1
    lb.resize(2, 2)
    assert [lb.in_flight(r) for r in range(4)] == [1, 0, 0, 0], "a removed rank has nothing in flight"
    assert (lb.engine_count, lb.size, lb.eligible) == (2, 2, (0, 1))


def test_resize_grow_gives_new_ranks_clean_counts() -> None:
    lb = LoadBalancer(2)
    lb.on_sent(1)
    lb.resize(3, 3)
    assert [lb.in_flight(r) for r in range(3)] == [0, 1, 0]
    assert [lb.score(r) for r in range(3)] == [0, 4, 0]
    assert lb.choose() == 0


def test_an_eligible_subset_is_intersected_with_the_size() -> None:
    lb = LoadBalancer(4, eligible=[1, 3])
    lb.resize(4, 2)
    assert lb.eligible == (1,)
    assert lb.choose() == 1
    lb.resize(6, 6)
    assert lb.eligible == (1, 3), "the node's own ranks stay its own as the cluster grows"
    lb.resize(1, 1)
    assert lb.eligible == ()
    with pytest.raises(ConfigError, match="dead or removed"):
        lb.choose()


def test_without_eligible_growth_adds_every_new_rank() -> None:
    lb = LoadBalancer(2)
    lb.resize(5, 4)
    assert lb.eligible == (0, 1, 2, 3)


@pytest.mark.parametrize(("engine_count", "size"), [(2, 3), (2, 0), (0, 0), (3, -1)])
def test_bad_resize_names_the_size(engine_count: int, size: int) -> None:
    lb = LoadBalancer(2)
    with pytest.raises(ConfigError, match=f"size={size}"):
        lb.resize(engine_count, size)
    assert (lb.engine_count, lb.size) == (2, 2)


# ---- membership ------------------------------------------------------------------------


def _eps(n: int) -> list[EngineEndpoint]:
    return [EngineEndpoint(r, f"node{r}", [f"ipc:///e{r}"]) for r in range(n)]


def test_membership_adopts_joined_ranks_and_the_size() -> None:
    snap = StatsSnapshot(
        counts=[(0, 0)] * 3, wave=0, running=False, size=3, moved={2: ["tcp://h:2"]}, nodes={2: "nodeX"}
    )
    engines, size = membership(_eps(2), snap)
    assert engines == [*_eps(2), EngineEndpoint(2, "nodeX", ["tcp://h:2"])]
    assert size == 3


def test_membership_waits_for_a_gap_and_the_ranks_after_it() -> None:
    snap = StatsSnapshot(counts=[(0, 0)] * 5, wave=0, running=False, size=5, moved={3: ["tcp://h:3"], 4: ["tcp://h:4"]})
    engines, size = membership(_eps(2), snap)
    assert [e.rank for e in engines] == [0, 1], "rank 2 has not joined: neither have 3 and 4 for us"
    assert size == 2, "the size is clamped to the ranks known"


def test_membership_size_follows_the_snapshot_while_ranks_join() -> None:
    snap = StatsSnapshot(counts=[(0, 0)] * 4, wave=0, running=False, size=2, moved={2: ["tcp://h:2"]})
    engines, size = membership(_eps(2), snap)
    assert ([e.rank for e in engines], size) == ([0, 1, 2], 2)


def test_membership_shrink_drops_removed_ranks() -> None:
    snap = StatsSnapshot(counts=[(0, 0)] * 2, wave=0, running=False, size=2)
    engines, size = membership(_eps(4), snap)
    assert (engines, size) == (_eps(2), 2)
    draining = StatsSnapshot(counts=[(0, 0)] * 4, wave=0, running=False, size=1)
    engines, size = membership(_eps(4), draining)
    assert (engines, size) == (_eps(4), 1)


def test_membership_of_an_old_snapshot_without_size_routes_to_all() -> None:
    snap = StatsSnapshot(counts=[(0, 0)] * 3, wave=0, running=False)
    assert membership(_eps(3), snap) == (_eps(3), 3)


def test_membership_keeps_the_known_address_of_a_known_rank() -> None:
    snap = StatsSnapshot(counts=[(0, 0)] * 2, wave=0, running=False, size=2, moved={1: ["tcp://new:1"]})
    engines, _ = membership(_eps(2), snap)
    assert engines == _eps(2), "a restart is followed by the liveness notices, not membership"


# ---- the gang hold through CoordinatorState ---------------------------------------------


def test_hold_broadcasts_hold_and_a_bad_gang_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    state = _state(engine_count=2)
    with caplog.at_level(logging.WARNING, logger="raydp.coordinator"):
        assert state.handle(HoldCluster(epoch=1, gang=3)) is None
        assert state.handle(HoldCluster(epoch=1, gang=0)) is None
    assert state.rejected == 2 and state.hold is None and "gang must be in [1, 2]" in caplog.text
    assert state.handle(HoldCluster(epoch=1, gang=2)) == Hold(1)
    assert state.hold_phase() == "holding"


def test_a_running_ack_wakes_the_gang_into_its_wave_exactly_once() -> None:
    state = _state(engine_count=3, wave=4)
    state.handle(HoldCluster(epoch=1, gang=3))
    assert state.handle(HoldAck(rank=1, epoch=1, wave=4, running=True)) == StartDPWave(wave=4, exclude=-1)
    assert (state.wave, state.running) == (4, True)
    assert state.handle(HoldAck(rank=2, epoch=1, wave=4, running=True)) is None
    assert state.handle(HoldAck(rank=0, epoch=1, wave=4, running=True)) is None
    assert state.handle(HoldAck(rank=1, epoch=1, wave=4, running=True)) is None


def test_no_wake_for_a_wave_the_coordinator_already_runs() -> None:
    state = _state(engine_count=2, wave=3, running=True)
    state.handle(HoldCluster(epoch=1, gang=2))
    assert state.handle(HoldAck(rank=0, epoch=1, wave=3, running=True)) is None


def test_a_running_ack_of_a_completed_wave_wakes_nobody() -> None:
    state = _state(engine_count=2, wave=6)
    state.handle(HoldCluster(epoch=1, gang=2))
    assert state.handle(HoldAck(rank=0, epoch=1, wave=5, running=True)) is None
    assert (state.wave, state.running) == (6, False)


def test_frozen_only_when_every_rank_paused_in_one_wave_past_the_woken_wave() -> None:
    state = _state(engine_count=2, wave=2)
    state.handle(HoldCluster(epoch=1, gang=2))
    state.handle(HoldAck(rank=0, epoch=1, wave=2, running=True))  # wakes wave 2
    state.handle(HoldAck(rank=1, epoch=1, wave=2, running=False))
    assert state.hold_phase() == "holding"
    state.handle(HoldAck(rank=1, epoch=1, wave=2, running=True))
    state.handle(HoldAck(rank=1, epoch=1, wave=3, running=False))
    assert state.hold_phase() == "holding", "rank 0 still steps in wave 2"
    state.handle(WaveComplete(rank=0, wave=2))
    state.handle(HoldAck(rank=0, epoch=1, wave=3, running=False))
    assert state.hold_phase() == "frozen"
    assert state.hold is not None and state.hold.frozen_wave() == 3


def test_paused_in_the_woken_wave_itself_is_not_frozen() -> None:
    state = _state(engine_count=2, wave=2)
    state.handle(HoldCluster(epoch=1, gang=2))
    state.handle(HoldAck(rank=0, epoch=1, wave=2, running=True))
    state.handle(HoldAck(rank=0, epoch=1, wave=2, running=False))
    state.handle(HoldAck(rank=1, epoch=1, wave=2, running=False))
    assert state.hold_phase() == "holding", "woken into wave 2, the gang has not paused past it"


def test_paused_ranks_in_different_waves_are_not_frozen() -> None:
    state = _state(engine_count=2, wave=2)
    state.handle(HoldCluster(epoch=1, gang=2))
    state.handle(HoldAck(rank=0, epoch=1, wave=2, running=False))
    state.handle(HoldAck(rank=1, epoch=1, wave=3, running=False))
    assert state.hold_phase() == "holding"


def test_an_idle_gang_freezes_at_once_and_regroups() -> None:
    state = _state(engine_count=3, wave=1)
    state.handle(HoldCluster(epoch=7, gang=3))
    for rank in range(3):
        state.handle(HoldAck(rank=rank, epoch=7, wave=1, running=False))
    assert state.hold_phase() == "frozen"
    regroup = state.handle(RegroupCluster(epoch=7, dp_size=2, dp_master="10.0.0.1:1"))
    assert regroup == Regroup(epoch=7, dp_size=2, dp_master="10.0.0.1:1", wave=1)
    assert state.hold_phase() == "regrouping"
    for rank in range(3):
        state.handle(Regrouped(rank=rank, epoch=7))
    assert state.hold_phase() == "regrouped"


def test_acks_of_ranks_outside_the_gang_do_not_count() -> None:
    state = _state(engine_count=3)
    state.handle(ScaleEngines(engine_count=3, size=2))
    state.handle(HoldCluster(epoch=1, gang=2))
    assert state.handle(HoldAck(rank=2, epoch=1, wave=0, running=True)) is None, "a joining rank wakes nobody"
    state.handle(HoldAck(rank=0, epoch=1, wave=0, running=False))
    assert state.hold_phase() == "holding"
    state.handle(HoldAck(rank=1, epoch=1, wave=0, running=False))
    assert state.hold_phase() == "frozen"


def test_regroup_before_frozen_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    state = _state(engine_count=2)
    state.handle(HoldCluster(epoch=1, gang=2))
    state.handle(HoldAck(rank=0, epoch=1, wave=0, running=False))
    with caplog.at_level(logging.WARNING, logger="raydp.coordinator"):
        assert state.handle(RegroupCluster(epoch=1, dp_size=3, dp_master="m:1")) is None
    assert state.rejected == 1 and "not frozen" in caplog.text
    assert state.hold_phase() == "holding"


def test_hold_messages_of_another_epoch_are_rejected() -> None:
    state = _state(engine_count=2)
    assert state.handle(ReleaseCluster(epoch=1)) is None  # no hold at all
    state.handle(HoldCluster(epoch=2, gang=2))
    assert state.handle(HoldAck(rank=0, epoch=1, wave=0, running=True)) is None
    assert state.handle(RegroupCluster(epoch=1, dp_size=2, dp_master="m:1")) is None
    assert state.handle(ReleaseCluster(epoch=1)) is None
    assert state.rejected == 4
    assert state.hold is not None and state.hold.acks == {} and not state.running


def _frozen(engine_count: int = 2, wave: int = 3) -> CoordinatorState:
    state = _state(engine_count=engine_count, wave=wave)
    state.handle(HoldCluster(epoch=1, gang=engine_count))
    for rank in range(engine_count):
        state.handle(HoldAck(rank=rank, epoch=1, wave=wave, running=False))
    assert state.hold_phase() == "frozen"
    return state


def test_requests_once_frozen_start_the_wave_on_release() -> None:
    state = _frozen(wave=3)
    assert state.handle(FirstRequest(rank=1, wave=3)) is None
    assert state.handle(StartWave(rank=0, wave=3)) is None
    assert not state.running and state.hold_phase() == "frozen"
    assert state.due_broadcasts(0.0) == [], "nothing starts while frozen"
    assert state.handle(ReleaseCluster(epoch=1)) == Release(1)
    assert state.hold is None and state.hold_phase() is None
    assert state.running
    assert state.due_broadcasts(0.5) == [StartDPWave(wave=3, exclude=-1)], "the deferred start goes at once"


def test_requests_while_regrouping_wait_for_the_release() -> None:
    state = _frozen(wave=3)
    state.handle(RegroupCluster(epoch=1, dp_size=2, dp_master="m:2"))
    assert state.handle(FirstRequest(rank=0, wave=3)) is None
    assert not state.running
    state.handle(ReleaseCluster(epoch=1))
    assert state.running


def test_a_request_before_the_gang_is_frozen_wakes_it_and_delays_the_freeze() -> None:
    """Its target may be stepping alone, stuck in the all-reduce where it cannot read the Hold."""
    state = _state(engine_count=2, wave=3)
    state.handle(HoldCluster(epoch=1, gang=2))
    state.handle(HoldAck(rank=1, epoch=1, wave=3, running=False))  # rank 0 never acks: it is in the all-reduce
    assert state.handle(FirstRequest(rank=0, wave=3)) == StartDPWave(wave=3, exclude=0)
    assert (state.wave, state.running) == (3, True)
    state.handle(HoldAck(rank=1, epoch=1, wave=3, running=True))
    state.handle(WaveComplete(rank=0, wave=3))
    state.handle(HoldAck(rank=0, epoch=1, wave=3, running=False))  # a stale position, sent before the wake
    state.handle(HoldAck(rank=1, epoch=1, wave=3, running=False))
    assert state.hold_phase() == "holding", "paused in the woken wave is not past it"
    state.handle(HoldAck(rank=0, epoch=1, wave=4, running=False))
    state.handle(HoldAck(rank=1, epoch=1, wave=4, running=False))
    assert state.hold_phase() == "frozen"


def test_a_start_wave_before_the_gang_is_frozen_wakes_it() -> None:
    state = _state(engine_count=2, wave=3)
    state.handle(HoldCluster(epoch=1, gang=2))
    assert state.handle(StartWave(rank=1, wave=5)) == StartDPWave(wave=5, exclude=1)
    assert state.hold is not None and state.hold.woke_wave == 5
    for rank in range(2):
        state.handle(HoldAck(rank=rank, epoch=1, wave=5, running=False))
    assert state.hold_phase() == "holding"


def test_release_with_no_deferred_start_and_no_load_stays_paused() -> None:
    state = _state(engine_count=2, wave=3)
    state.handle(HoldCluster(epoch=1, gang=2))
    state.handle(ReleaseCluster(epoch=1))
    assert not state.running
    assert state.due_broadcasts(10.0) == []


def test_release_with_queued_work_starts_a_wave() -> None:
    state = _state(engine_count=2, wave=3)
    state.handle(HoldCluster(epoch=1, gang=2))
    state.handle(EngineStats(rank=1, waiting=2, running=0))  # a request reached a held rank
    state.handle(ReleaseCluster(epoch=1))
    assert state.running
    assert state.due_broadcasts(10.0) == [StartDPWave(wave=3, exclude=-1)]


@pytest.mark.parametrize("frozen", [False, True])
def test_a_bad_rank_request_during_hold_starts_nothing(frozen: bool) -> None:
    state = _frozen(wave=0) if frozen else _state(engine_count=2)
    if not frozen:
        state.handle(HoldCluster(epoch=1, gang=2))
    assert state.handle(FirstRequest(rank=5, wave=0)) is None
    assert state.handle(StartWave(rank=-1, wave=0)) is None
    assert state.rejected == 2 and not state.running
    state.handle(ReleaseCluster(epoch=1))
    assert not state.running


def test_hold_is_repeated_every_heartbeat_until_every_rank_acked() -> None:
    state = _state(engine_count=2)
    state.handle(HoldCluster(epoch=1, gang=2))
    assert state.due_broadcasts(10.0) == [Hold(1)]
    assert state.due_broadcasts(10.5) == []
    assert state.due_broadcasts(11.0) == [Hold(1)]
    state.handle(HoldAck(rank=0, epoch=1, wave=0, running=False))
    assert state.due_broadcasts(12.0) == [Hold(1)]
    state.handle(HoldAck(rank=1, epoch=1, wave=0, running=False))
    assert state.due_broadcasts(13.0) == []
    assert state.due_broadcasts(20.0) == []


def test_regroup_is_repeated_every_heartbeat_until_every_rank_regrouped() -> None:
    state = _state(engine_count=2)
    state.handle(HoldCluster(epoch=1, gang=2))
    for rank in range(2):
        state.handle(HoldAck(rank=rank, epoch=1, wave=0, running=False))
    regroup = state.handle(RegroupCluster(epoch=1, dp_size=1, dp_master="m:9"))
    assert regroup is not None
    assert state.due_broadcasts(5.0) == [regroup]
    assert state.due_broadcasts(5.5) == []
    state.handle(Regrouped(rank=1, epoch=1))
    assert state.due_broadcasts(6.0) == [regroup]
    state.handle(Regrouped(rank=0, epoch=1))
    assert state.hold_phase() == "regrouped"
    assert state.due_broadcasts(7.0) == []


def test_a_running_wave_and_the_hold_are_both_repeated() -> None:
    state = _state(engine_count=2, wave=1, running=True)
    state.handle(HoldCluster(epoch=3, gang=2))
    assert state.due_broadcasts(0.0) == [StartDPWave(wave=1, exclude=-1), Hold(3)]


# ---- EngineWaves: a wave ended by a peer's hold --------------------------------------------


def test_a_rank_paused_by_a_peers_hold_starts_no_wave_alone() -> None:
    from raydp.engine.waves import EngineWaves

    waves = EngineWaves(rank=0, interval=1, wave=2, running=True)
    assert waves.on_allreduce(True, True) == 2, "anyone held: the wave ends, work or not"
    assert (waves.wave, waves.running, waves.held) == (3, False, False)
    assert waves.should_step(has_local_work=True) is False, "its peers are pausing for the hold: nobody would join"
    waves.on_start_wave(2)  # a stale broadcast changes nothing
    assert waves.should_step(has_local_work=True) is False
    waves.on_start_wave(3)
    assert waves.should_step(has_local_work=False) is True
    assert waves.on_allreduce(False, False) == 3
    assert waves.should_step(has_local_work=True) is True, "a normal pause: a new request may start a wave"


def test_late_answers_to_a_finished_change_are_dropped_quietly_but_a_foreign_epoch_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = _frozen()
    assert state.handle(RegroupCluster(epoch=1, dp_size=2, dp_master="10.0.0.1:1")) is not None
    state.handle(Regrouped(rank=0, epoch=1))
    state.handle(ReleaseCluster(epoch=1))
    with caplog.at_level(logging.WARNING, logger="raydp.coordinator"):
        state.handle(Regrouped(rank=1, epoch=1))  # answered a Regroup repeated before the release
        state.handle(HoldAck(rank=1, epoch=1, wave=3, running=False))
        assert caplog.text == "" and state.rejected == 0
        state.handle(Regrouped(rank=1, epoch=7))  # no change of that epoch ever ran
    assert state.rejected == 1 and "no hold of that epoch" in caplog.text
