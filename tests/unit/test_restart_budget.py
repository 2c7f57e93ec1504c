"""RestartBudget: restarts per rank within a sliding window, each repeat after a doubling backoff."""

from __future__ import annotations

from raydp.orchestration.budget import RestartBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_rank_has_its_own_budget() -> None:
    budget = RestartBudget(2, range(2))
    assert [budget.take(0), budget.take(0), budget.take(0)] == [0.0, 0.0, None]
    assert budget.take(1) == 0.0, "rank 1's budget is its own"


def test_unknown_ranks_have_none_until_granted() -> None:
    budget = RestartBudget(1)
    assert budget.take(3) is None
    budget.grant(range(3, 5))
    assert budget.take(3) is not None and budget.take(4) is not None and budget.take(3) is None


def test_a_forgotten_rank_restarts_no_more() -> None:
    budget = RestartBudget(5, range(2))
    budget.forget(1)
    assert budget.take(0) == 0.0 and budget.take(1) is None


def test_repeats_in_a_window_back_off_doubling_up_to_the_cap() -> None:
    clock = Clock()
    budget = RestartBudget(5, [0], window_s=600, backoff_s=2, backoff_max_s=5, clock=clock)
    delays = []
    for _ in range(6):
        delays.append(budget.take(0))
        clock.now += 1
    assert delays == [0.0, 2.0, 4.0, 5.0, 5.0, None]


def test_restarts_older_than_the_window_no_longer_count() -> None:
    clock = Clock()
    budget = RestartBudget(2, [0], window_s=600, backoff_s=2, backoff_max_s=60, clock=clock)
    assert budget.take(0) == 0.0 and budget.take(0) == 2.0 and budget.take(0) is None
    clock.now = 600.0
    assert budget.take(0) == 0.0, "a window later the budget and the backoff are whole again"
