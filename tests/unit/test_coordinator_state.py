"""CoordinatorState: every handle() branch and the snapshot publishing schedule."""

from __future__ import annotations

import logging

import pytest

from raydp.coordinator.state import CoordinatorState
from raydp.wire.control import (
    EngineDead,
    EngineRevived,
    EngineStats,
    FirstRequest,
    ScaleEngines,
    StartDPWave,
    StartWave,
    StatsSnapshot,
    WaveComplete,
)


def _state(engine_count: int = 3, wave: int = 0, running: bool = False) -> CoordinatorState:
    state = CoordinatorState(engine_count=engine_count, wave=wave, running=running)
    state.changed = False  # as if the initial snapshot went out
    return state


# ---- first request ----------------------------------------------------------------------


def test_first_request_while_paused_starts_the_wave_excluding_the_target() -> None:
    state = _state()
    assert state.handle(FirstRequest(rank=2, wave=0)) == StartDPWave(wave=0, exclude=2)
    assert state.running is True
    assert state.wave == 0
    assert state.changed is True


def test_first_request_while_running_broadcasts_nothing() -> None:
    state = _state()
    state.handle(FirstRequest(rank=1, wave=0))
    state.changed = False
    assert state.handle(FirstRequest(rank=0, wave=0)) is None
    assert (state.wave, state.running, state.changed) == (0, True, False)


def test_stale_first_request_wakes_everyone_into_the_current_wave() -> None:
    state = _state(wave=4)
    # The client's snapshot said wave 2: its target may have paused in a later wave.
    assert state.handle(FirstRequest(rank=1, wave=2)) == StartDPWave(wave=4, exclude=-1)
    assert state.running is True
    assert state.wave == 4


# ---- wave complete ----------------------------------------------------------------------


def test_wave_complete_advances_the_wave_and_pauses() -> None:
    state = _state()
    state.handle(FirstRequest(rank=0, wave=0))
    state.changed = False
    assert state.handle(WaveComplete(rank=0, wave=0)) is None
    assert (state.wave, state.running, state.changed) == (1, False, True)


def test_wave_complete_for_a_newer_wave_jumps_past_it() -> None:
    state = _state(wave=1, running=True)
    assert state.handle(WaveComplete(rank=0, wave=3)) is None
    assert (state.wave, state.running) == (4, False)


def test_older_wave_complete_is_ignored() -> None:
    state = _state(wave=5, running=True)
    assert state.handle(WaveComplete(rank=0, wave=4)) is None
    assert (state.wave, state.running, state.changed) == (5, True, False)


# ---- start wave -------------------------------------------------------------------------


def test_start_wave_for_a_newer_wave_rebroadcasts_excluding_the_sender() -> None:
    state = _state(wave=2, running=True)  # the wave_complete for 2 is still on its way
    assert state.handle(StartWave(rank=1, wave=3)) == StartDPWave(wave=3, exclude=1)
    assert (state.wave, state.running, state.changed) == (3, True, True)


def test_start_wave_for_the_current_paused_wave_rebroadcasts_excluding_the_sender() -> None:
    state = _state(wave=3, running=False)
    assert state.handle(StartWave(rank=2, wave=3)) == StartDPWave(wave=3, exclude=2)
    assert (state.wave, state.running) == (3, True)


def test_start_wave_for_the_current_running_wave_is_ignored() -> None:
    state = _state(wave=3, running=True)
    assert state.handle(StartWave(rank=2, wave=3)) is None
    assert (state.wave, state.running, state.changed) == (3, True, False)


def test_start_wave_for_an_older_wave_is_ignored() -> None:
    state = _state(wave=3, running=False)
    assert state.handle(StartWave(rank=0, wave=2)) is None
    assert (state.wave, state.running, state.changed) == (3, False, False)


# ---- stats and scaling ------------------------------------------------------------------


def test_stats_change_updates_counts_and_marks_changed() -> None:
    state = _state()
    assert state.handle(EngineStats(rank=1, waiting=4, running=2)) is None
    assert state.counts == [[0, 0], [4, 2], [0, 0]]
    assert state.changed is True


def test_unchanged_stats_do_not_mark_changed() -> None:
    state = _state()
    state.handle(EngineStats(rank=1, waiting=4, running=2))
    state.changed = False
    state.handle(EngineStats(rank=1, waiting=4, running=2))
    assert state.changed is False


def test_work_is_published_only_once_an_engine_reports_it() -> None:
    state = _state()
    state.handle(EngineStats(rank=0, waiting=0, running=1))
    snap = state.due_snapshot(10.0)
    assert snap is not None and snap.work == [], "an engine without work(): clients route by counts"
    state.handle(EngineStats(rank=0, waiting=0, running=1, work=60))
    assert state.changed is True, "the same counts with new work is a change"
    snap = state.due_snapshot(20.0)
    assert snap is not None and snap.work == [60, -1, -1]


def test_a_dead_rank_has_no_work_left() -> None:
    state = _state()
    state.handle(EngineStats(rank=2, waiting=1, running=2, work=90))
    state.handle(EngineDead(rank=2, cause="killed"))
    snap = state.due_snapshot(10.0)
    assert snap is not None and snap.work == [-1, -1, 0] and snap.counts[2] == (0, 0)


@pytest.mark.parametrize("rank", [-1, 3, 1000])
def test_stats_for_an_unknown_rank_are_dropped(rank: int) -> None:
    state = _state()
    assert state.handle(EngineStats(rank=rank, waiting=1, running=1)) is None
    assert state.counts == [[0, 0], [0, 0], [0, 0]]
    assert state.changed is False


def test_negative_stats_are_clamped_to_zero() -> None:
    state = _state()
    state.handle(EngineStats(rank=0, waiting=-3, running=2))
    assert state.counts[0] == [0, 2]


def test_scale_up_adds_idle_ranks_and_keeps_existing_counts() -> None:
    state = _state(engine_count=2)
    state.handle(EngineStats(rank=1, waiting=1, running=5))
    state.changed = False
    assert state.handle(ScaleEngines(engine_count=4)) is None
    assert state.engine_count == 4
    assert state.counts == [[0, 0], [1, 5], [0, 0], [0, 0]]
    assert state.changed is True
    state.handle(EngineStats(rank=3, waiting=7, running=0))
    assert state.counts[3] == [7, 0]


def test_scale_down_drops_the_removed_ranks() -> None:
    state = _state(engine_count=4)
    state.handle(EngineStats(rank=3, waiting=2, running=2))
    state.changed = False
    state.handle(ScaleEngines(engine_count=2))
    assert state.engine_count == 2
    assert state.counts == [[0, 0], [0, 0]]
    assert state.changed is True
    state.handle(EngineStats(rank=3, waiting=9, running=9))  # the removed rank is gone
    assert state.counts == [[0, 0], [0, 0]]


def test_scale_does_not_touch_the_wave() -> None:
    state = _state(wave=6, running=True)
    state.handle(ScaleEngines(engine_count=5))
    assert (state.wave, state.running) == (6, True)


# ---- publishing -------------------------------------------------------------------------


def test_first_snapshot_is_due_at_once_and_carries_the_state() -> None:
    state = CoordinatorState(engine_count=2)
    assert state.next_deadline(100.0) == 0.0
    snap = state.due_snapshot(100.0)
    assert snap == StatsSnapshot(counts=[(0, 0), (0, 0)], wave=0, running=False, seq=1, size=2)


def test_changes_publish_at_most_once_per_stats_interval() -> None:
    state = CoordinatorState(engine_count=2, stats_interval_s=0.5, heartbeat_interval_s=4.0)
    assert state.due_snapshot(10.0) is not None
    state.handle(EngineStats(rank=0, waiting=1, running=0))
    assert state.due_snapshot(10.25) is None  # changed, but the interval has not passed
    assert state.next_deadline(10.25) == pytest.approx(0.25)
    snap = state.due_snapshot(10.5)
    assert snap is not None
    assert snap.counts == [(1, 0), (0, 0)]
    assert snap.seq == 2
    # Nothing changed since: nothing until the heartbeat.
    assert state.due_snapshot(11.0) is None
    assert state.next_deadline(11.0) == pytest.approx(3.5)


def test_unchanged_state_publishes_only_a_heartbeat() -> None:
    state = CoordinatorState(engine_count=1, stats_interval_s=0.5, heartbeat_interval_s=4.0)
    first = state.due_snapshot(0.0)
    assert first is not None
    for now in (0.5, 1.0, 2.0, 3.75):
        assert state.due_snapshot(now) is None, f"published at {now} with nothing changed"
    beat = state.due_snapshot(4.0)
    assert beat is not None
    assert (beat.counts, beat.wave, beat.running) == (first.counts, first.wave, first.running)
    assert beat.seq == first.seq + 1


def test_wave_messages_make_a_snapshot_due() -> None:
    state = CoordinatorState(engine_count=2, stats_interval_s=0.5, heartbeat_interval_s=4.0)
    state.due_snapshot(0.0)
    state.handle(FirstRequest(rank=0, wave=0))
    snap = state.due_snapshot(0.5)
    assert snap is not None
    assert (snap.wave, snap.running) == (0, True)
    state.handle(WaveComplete(rank=0, wave=0))
    snap = state.due_snapshot(1.0)
    assert snap is not None
    assert (snap.wave, snap.running) == (1, False)


def test_next_deadline_is_never_negative() -> None:
    state = CoordinatorState(engine_count=1, stats_interval_s=0.5, heartbeat_interval_s=4.0)
    state.due_snapshot(0.0)
    assert state.next_deadline(100.0) == 0.0
    state.handle(EngineStats(rank=0, waiting=1, running=1))
    assert state.next_deadline(0.1) == pytest.approx(0.4)


def test_snapshot_counts_are_a_copy() -> None:
    state = CoordinatorState(engine_count=1)
    snap = state.due_snapshot(0.0)
    assert snap is not None
    state.handle(EngineStats(rank=0, waiting=3, running=3))
    assert snap.counts == [(0, 0)]


def test_scale_to_zero_is_rejected_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    state = CoordinatorState(2)
    state.handle(EngineStats(rank=1, waiting=2, running=1))
    with caplog.at_level(logging.WARNING):
        state.handle(ScaleEngines(engine_count=0))
    assert state.engine_count == 2 and state.rejected == 1
    assert state.counts == [[0, 0], [2, 1]], "a rejected message changes nothing"
    assert "ScaleEngines" in caplog.text and "engine_count=0" in caplog.text


def test_a_size_that_would_leave_no_decode_rank_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    state = CoordinatorState(4)
    state.handle(ScaleEngines(engine_count=4, size=4, prefill=2))
    assert (state.prefill_ranks, state.rejected) == (2, 0)
    with caplog.at_level(logging.WARNING):
        state.handle(ScaleEngines(engine_count=2, size=2))  # keeps 2 prefill ranks of 2: no decode pool
    assert (state.engine_count, state.size, state.prefill_ranks, state.rejected) == (4, 4, 2, 1)
    assert "size=2" in caplog.text and "prefill ranks" in caplog.text
    state.handle(ScaleEngines(engine_count=4, size=4, prefill=1))  # the launcher's order: the boundary first
    state.handle(ScaleEngines(engine_count=2, size=2))
    assert (state.engine_count, state.size, state.prefill_ranks, state.rejected) == (2, 2, 1, 1)


def test_messages_for_unknown_ranks_are_rejected_without_effect() -> None:
    state = CoordinatorState(2)
    assert state.handle(FirstRequest(rank=7, wave=0)) is None
    assert state.handle(StartWave(rank=-1, wave=3)) is None
    state.handle(EngineStats(rank=2, waiting=5, running=5))
    assert (state.running, state.wave, state.counts, state.rejected) == (False, 0, [[0, 0], [0, 0]], 3)


def test_dead_and_revived_ranks_are_published() -> None:
    state = CoordinatorState(2, stats_interval_s=0.1, heartbeat_interval_s=1.0)
    state.handle(EngineStats(rank=1, waiting=3, running=1))
    state.handle(EngineDead(rank=1, cause="killed"))
    snap = state.due_snapshot(now=10.0)
    assert snap is not None and snap.dead == {1: "killed"} and snap.counts[1] == (0, 0)
    state.handle(EngineRevived(rank=1, input_addresses=["ipc:///x"]))
    snap = state.due_snapshot(now=10.2)
    assert snap is not None and snap.dead == {} and snap.moved == {1: ["ipc:///x"]}


def test_a_running_wave_is_rebroadcast_every_heartbeat() -> None:
    state = CoordinatorState(2, heartbeat_interval_s=1.0)
    assert state.due_rebroadcast(now=5.0) is None, "paused: nothing to repeat"
    wake = state.handle(FirstRequest(rank=0, wave=0))
    assert wake is not None
    state.note_broadcast(now=5.0)
    assert state.due_rebroadcast(now=5.5) is None
    assert state.due_rebroadcast(now=6.0) == StartDPWave(wave=0, exclude=-1)


def test_deaths_and_restarts_are_tallied_per_rank_once_each() -> None:
    state = _state(engine_count=2)
    state.handle(EngineDead(rank=1, cause="killed"))
    state.handle(EngineDead(rank=1, cause="killed"))  # reported by the launcher and a client: one death
    state.handle(EngineRevived(rank=1, input_addresses=["ipc:///a"]))
    state.handle(EngineDead(rank=1, cause="process died"))
    state.handle(EngineRevived(rank=1, input_addresses=["tcp://10.0.0.1:1"]))
    assert (state.deaths, state.restarts) == ([0, 2], [0, 2])
    state.handle(ScaleEngines(engine_count=3))
    assert (state.deaths, state.restarts) == ([0, 2, 0], [0, 2, 0])
