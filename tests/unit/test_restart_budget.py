"""RestartBudget: restarts left per rank, shared by both backends' dense restarts."""

from __future__ import annotations

import pytest

from raydp.backend import RestartBudget

pytestmark = pytest.mark.timeout(10)


def test_each_rank_spends_its_own_budget() -> None:
    budget = RestartBudget(2, range(2))
    assert [budget.take(0), budget.take(0), budget.take(0)] == [True, True, False]
    assert budget.take(1), "rank 1's budget is its own"


def test_ranks_granted_later_get_the_full_budget_and_unknown_ones_none() -> None:
    budget = RestartBudget(1)
    assert not budget.take(3)
    budget.grant(range(3, 5))
    assert budget.take(3) and budget.take(4) and not budget.take(3)


def test_an_exhausted_or_forgotten_rank_restarts_no_more() -> None:
    budget = RestartBudget(5, range(2))
    budget.exhaust(0)
    budget.forget(1)
    assert not budget.take(0) and not budget.take(1)
