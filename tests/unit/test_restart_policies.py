"""The restart policies over the in-memory runtime: a lockstep gang's budget, window and backoff."""

from __future__ import annotations

import time

import pytest

from raydp.coordinator.state import CoordinatorState
from raydp.errors import DeathCause, EngineDeadError
from raydp.orchestration.core import Orchestrator
from raydp.wire.control import coordinator_decoder
from tests.unit.orchestration_model import ModelCoordinator, ModelRuntime, started

pytestmark = pytest.mark.timeout(60)


def _gang(**fields: object) -> tuple[Orchestrator, ModelRuntime]:
    coord = CoordinatorState(engine_count=2, stats_interval_s=0.125, heartbeat_interval_s=1.0)
    runtime = ModelRuntime(lambda: coord)
    control = ModelCoordinator(lambda body: coord.handle(coordinator_decoder(body)))
    return started(2, runtime, control, lockstep=True, **fields), runtime


def _settle(o: Orchestrator) -> None:
    for thread in list(o.controls.threads):
        thread.join(10)
        assert not thread.is_alive(), "a restart never ended"


def _first_deaths(o: Orchestrator) -> list[EngineDeadError]:
    """The death each report made (its gang peers' follow it)."""
    return [d for d in o.reports.deaths if isinstance(d, EngineDeadError) and d.rank == 1]


def test_a_gang_restarts_within_its_budget_then_stops_every_rank() -> None:
    o, runtime = _gang(max_restarts=2, restart_backoff_s=0)
    for _ in range(2):
        o.report(1, DeathCause.KILLED, "SIGKILL")
        _settle(o)
        assert runtime.alive == {0, 1}, "the gang came back whole"
    o.report(1, DeathCause.KILLED, "SIGKILL")
    _settle(o)
    assert [d.restarting for d in _first_deaths(o)] == [True, True, False]
    assert runtime.alive == {1}, "past its budget the gang stops: the other ranks are ended"
    assert [r.restarts for r in o.table] == [2, 2]


def test_a_gang_restart_older_than_the_window_no_longer_counts() -> None:
    o, runtime = _gang(max_restarts=1, restart_backoff_s=0, restart_window_s=0.01)
    for _ in range(3):
        time.sleep(0.05)  # longer than the window, however fast the machine: the last restart has left it
        o.report(0, DeathCause.KILLED, "SIGKILL")
        _settle(o)
        assert runtime.alive == {0, 1}
    assert [r.restarts for r in o.table] == [3, 3]


def test_a_repeated_gang_restart_waits_its_backoff_and_a_close_cancels_it() -> None:
    o, runtime = _gang(max_restarts=3, restart_backoff_s=30)
    o.report(1, DeathCause.KILLED, "SIGKILL")
    _settle(o)  # the first restart is at once
    o.report(1, DeathCause.KILLED, "SIGKILL")  # the second waits 30 s: stopped now, started then
    assert [d.restarting for d in _first_deaths(o)] == [True, True]
    o.controls.owned.release()  # closing during the backoff: no successor
    _settle(o)
    assert runtime.alive == set(), "no successor started after the close"
