"""How long a lockstep rank keeps its "unfinished work" all-reduce in flight: an interval, paced by time.

With near-empty steps (tens of µs), 32 steps would mean thousands of gloo
all-reduces a second. Each all-reduce also carries how many steps make
``min_interval_s`` at the rank's pace, and the next one stays in flight for
the MAX of those: ranks agree on it through the all-reduce, never by their
own clocks, so ranks stepping together (an expert-parallel forward pass
all-reduces every step) collect, confirm and start at the same step.
"""

from __future__ import annotations

from typing import Any

import pytest

from raydp.engine.lockstep import LockstepRank
from raydp.engine.waves import EngineWaves
from raydp.wire.control import WaveComplete

pytestmark = pytest.mark.timeout(10)

INTERVAL, FLOOR_S = 4, 0.005


class Rounds:
    """The all-reduces of one DP group in one process: round -> rank -> (unfinished, hold, pace)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.rounds: dict[int, dict[int, tuple[bool, bool, int]]] = {}


class Member:
    """One rank's handle: a round arrives once every member started it; collect gives the MAX."""

    group = master = "pair"

    def __init__(self, shared: Rounds, rank: int) -> None:
        self.shared, self.rank = shared, rank
        self.started = self.collected = self.synced = 0
        self.last_pace = 0
        self.collect_steps: list[int] = []
        self.late = False  # gloo's thread has not finished it yet

    def start(self, unfinished: bool, hold: bool, pace: int = 0) -> None:
        self.shared.rounds.setdefault(self.started, {})[self.rank] = (unfinished, hold, pace)
        self.started += 1

    def _round(self) -> dict[int, tuple[bool, bool, int]]:
        return self.shared.rounds.get(self.started - 1, {})

    def arrived(self) -> bool:
        return self.started > self.collected and len(self._round()) == self.shared.size and not self.late

    def collect(self) -> tuple[bool, bool]:
        found = self._round().values()
        self.collected += 1
        self.last_pace = max(p for _, _, p in found)
        return max(u for u, _, _ in found), max(h for _, h, _ in found)

    def sync(self, unfinished: bool, hold: bool) -> tuple[bool, bool]:
        self.synced += 1
        return unfinished, hold  # each test confirms with every rank's flags alike

    def close(self) -> None:
        pass


class Clock:
    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now


def _ranks(
    step_s: list[float], floor_s: float = FLOOR_S, in_step: bool | None = False
) -> list[tuple[LockstepRank, Member, Clock, list[Any]]]:
    """Ranks whose engine says ``in_step`` from ``attach_dp_group`` (False: no collectives of its own)."""
    shared = Rounds(len(step_s))
    made = []
    for r, each in enumerate(step_s):
        member, clock, sent = Member(shared, r), Clock(each), []
        rank = LockstepRank(
            r,
            EngineWaves(r, INTERVAL),
            member,
            sent.append,
            attach=lambda group: in_step,
            min_interval_s=floor_s,
            clock=clock,
        )
        rank.waves.on_start_wave(0)
        made.append((rank, member, clock, sent))
    return made


def _step_together(ranks: list[tuple[LockstepRank, Member, Clock, list[Any]]], n: int, unfinished: bool = True) -> None:
    """``n`` steps, every rank once per step, as a per-step collective would keep them."""
    for _ in range(n):
        for rank, member, clock, _ in ranks:
            if not rank.should_step(unfinished):
                continue  # paused: the loop waits for input
            clock.now += clock.step_s
            collected = member.collected
            rank.after_step(unfinished)
            if member.collected > collected:
                member.collect_steps.append(rank.waves.steps)


def test_the_next_all_reduce_stays_in_flight_for_the_steps_that_make_the_floor() -> None:
    ranks = _ranks([0.0001])  # 0.1 ms steps: 50 of them make 5 ms
    member = ranks[0][1]
    _step_together(ranks, 2 * INTERVAL)
    assert member.collect_steps == [2 * INTERVAL], "the first one: the interval alone (no pace measured yet)"
    _step_together(ranks, 49)
    assert member.collected == 1, "the second stays in flight for 50 steps, not 4"
    _step_together(ranks, 1)
    assert member.collect_steps == [2 * INTERVAL, 2 * INTERVAL + 50]


def test_slow_steps_keep_the_step_interval() -> None:
    ranks = _ranks([0.01])  # 10 ms steps: the floor is shorter than one interval
    _step_together(ranks, 5 * INTERVAL)
    assert ranks[0][1].collect_steps == [2 * INTERVAL, 3 * INTERVAL, 4 * INTERVAL, 5 * INTERVAL]


def test_ranks_with_different_clocks_collect_at_the_same_steps() -> None:
    ranks = _ranks([0.0001, 0.00025])  # their clocks disagree on the pace: the MAX wins, for both
    _step_together(ranks, 300)
    steps = [member.collect_steps for _, member, _, _ in ranks]
    assert steps[0] == steps[1], f"the ranks collected at different steps: {steps}"
    gaps = [b - a for a, b in zip(steps[0][1:], steps[0][2:], strict=False)]
    # 50 steps per 5 ms, the faster rank's pace (51 where its float clock rounds up)
    assert gaps and all(50 <= gap <= 51 for gap in gaps), f"not paced by the faster rank: {gaps}"


def test_without_a_floor_the_interval_alone_paces_the_all_reduces() -> None:
    ranks = _ranks([0.0001], floor_s=0.0)
    _step_together(ranks, 5 * INTERVAL)
    assert ranks[0][1].collect_steps == [2 * INTERVAL, 3 * INTERVAL, 4 * INTERVAL, 5 * INTERVAL]


def test_a_wave_completes_at_the_agreed_step_and_the_next_starts_at_the_interval() -> None:
    ranks = _ranks([0.0001, 0.0001])
    _step_together(ranks, 3 * INTERVAL)
    _step_together(ranks, 200, unfinished=False)
    for rank, member, _, _ in ranks:
        assert member.synced == 1 and not rank.waves.running and rank.waves.wave == 1
        assert rank.waves.due == 0, "a new wave starts from the plain interval"
    assert ranks[0][3] == [WaveComplete(rank=0, wave=0)]
    assert ranks[0][1].collect_steps == ranks[1][1].collect_steps


@pytest.mark.parametrize("in_step", [True, None])
def test_ranks_that_step_together_collect_when_due_even_before_it_arrived(in_step: bool | None) -> None:
    """An engine all-reducing every step (``attach_dp_group`` returns True, or nothing): a rank that took
    the result a step later than its peer would pair its confirmation with the peer's forward pass."""
    ranks = _ranks([0.01, 0.01], in_step=in_step)
    for _, member, _, _ in ranks:
        member.late = True
    _step_together(ranks, 2 * INTERVAL)
    assert [m.collect_steps for _, m, _, _ in ranks] == [[2 * INTERVAL]] * 2


def test_ranks_that_do_not_step_together_wait_for_it_to_arrive() -> None:
    ranks = _ranks([0.01, 0.01], in_step=False)
    ranks[1][1].late = True
    _step_together(ranks, 3 * INTERVAL)
    assert ranks[1][1].collect_steps == [], "it keeps stepping; it takes the result once it is there"
    assert ranks[0][1].collect_steps == [2 * INTERVAL], "and its peer, the next one once rank 1 started it"
    ranks[1][1].late = False
    _step_together(ranks, 1)
    assert ranks[1][1].collect_steps == [3 * INTERVAL + 1]
    _step_together(ranks, 1)
    assert ranks[0][1].collect_steps == [2 * INTERVAL, 3 * INTERVAL + 2]
