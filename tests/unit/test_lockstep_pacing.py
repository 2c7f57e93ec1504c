"""How often a lockstep rank collects its "unfinished work" all-reduce: an interval of steps, and a time floor.

With near-empty steps (tens of µs), 32 steps would mean thousands of gloo
all-reduces a second; ``min_interval_s`` keeps them apart in time as well. To
the protocol the floor is the same as a round that has not arrived yet, which
the stateful models (``test_waves_stateful.py``, ``test_scaling_properties.py``)
explore; here: the floor holds, and it delays nothing but the collect.
"""

from __future__ import annotations

from typing import Any

import pytest

from raydp.engine.lockstep import LockstepRank
from raydp.engine.waves import EngineWaves
from raydp.wire.protocol import WaveComplete

pytestmark = pytest.mark.timeout(10)

INTERVAL, FLOOR_S = 4, 0.005


class SoloGroup:
    """A DP group of one rank: each all-reduce arrives at once and returns the rank's own flags."""

    master = group = "solo"

    def __init__(self) -> None:
        self.started = self.collected = self.synced = 0
        self._flags = (False, False)

    def start(self, unfinished: bool, hold: bool) -> None:
        self.started += 1
        self._flags = (unfinished, hold)

    def arrived(self) -> bool:
        return self.started > self.collected

    def collect(self) -> tuple[bool, bool]:
        self.collected += 1
        return self._flags

    def sync(self, unfinished: bool, hold: bool) -> tuple[bool, bool]:
        self.synced += 1
        return unfinished, hold

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _rank(floor_s: float) -> tuple[LockstepRank, SoloGroup, Clock, list[Any]]:
    group, clock, sent = SoloGroup(), Clock(), []
    rank = LockstepRank(0, EngineWaves(0, INTERVAL), group, sent.append, min_interval_s=floor_s, clock=clock)
    rank.waves.on_start_wave(0)
    return rank, group, clock, sent


def _steps(rank: LockstepRank, n: int, unfinished: bool = True) -> None:
    for _ in range(n):
        rank.after_step(unfinished)


def test_an_arrived_all_reduce_waits_for_the_time_floor_then_is_collected() -> None:
    rank, group, clock, _ = _rank(FLOOR_S)
    _steps(rank, INTERVAL)
    assert group.started == 1 and group.collected == 0
    _steps(rank, 10 * INTERVAL)  # many intervals of steps, no time passed: still in flight
    assert group.collected == 0 and rank.waves.pending
    clock.now += FLOOR_S
    _steps(rank, 1)
    assert group.collected == 1, "collected at the first step past both the interval and the floor"
    assert group.started == 2, "and the next one started at once: the wave goes on"


def test_the_floor_does_not_replace_the_step_interval() -> None:
    rank, group, clock, _ = _rank(FLOOR_S)
    _steps(rank, INTERVAL)
    clock.now += 10 * FLOOR_S
    _steps(rank, INTERVAL - 1)
    assert group.collected == 0, "old enough in time, but not an interval of steps yet"
    _steps(rank, 1)
    assert group.collected == 1


def test_without_a_floor_the_step_interval_alone_paces_the_collects() -> None:
    rank, group, _, _ = _rank(0.0)
    _steps(rank, 5 * INTERVAL)
    assert group.collected == 4 and group.started == 5


def test_a_wave_with_no_work_left_still_completes_once_the_floor_passes() -> None:
    rank, group, clock, sent = _rank(FLOOR_S)
    _steps(rank, INTERVAL, unfinished=False)
    _steps(rank, INTERVAL, unfinished=False)
    assert rank.waves.running and not sent, "no pause before the floor"
    clock.now += FLOOR_S
    _steps(rank, 1, unfinished=False)
    assert group.synced == 1, "the pause is confirmed with a blocking all-reduce"
    assert not rank.waves.running and rank.waves.wave == 1
    assert sent == [WaveComplete(rank=0, wave=0)]
