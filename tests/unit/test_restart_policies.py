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
    """Until no restart runs (a failed restart starts the next one from its own thread)."""
    while running := [t for t in list(o.controls.threads) if t.is_alive()]:
        for thread in running:
            thread.join(10)
            assert not thread.is_alive(), "a restart never ended"


def _dense(**fields: object) -> tuple[Orchestrator, ModelRuntime]:
    coord = CoordinatorState(engine_count=2, stats_interval_s=0.125, heartbeat_interval_s=1.0)
    runtime = ModelRuntime(lambda: coord)
    control = ModelCoordinator(lambda body: coord.handle(coordinator_decoder(body)))
    return started(2, runtime, control, **fields), runtime


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
    assert runtime.alive == set(), "past its budget the gang stops: every rank is ended, the dead one's process too"
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


@pytest.mark.parametrize("lockstep", [False, True])
def test_a_restart_that_wedges_is_tried_again_within_the_budget(lockstep: bool) -> None:
    o, runtime = (_gang if lockstep else _dense)(max_restarts=3, restart_backoff_s=0)
    runtime.wedged_starts = 2  # a transient wedge: the third start serves
    o.report(1, DeathCause.KILLED, "SIGKILL")
    _settle(o)
    assert runtime.alive == {0, 1}, "the rank came back on its third start"
    causes = [(d.cause, d.restarting) for d in _first_deaths(o)]
    assert causes == [
        (DeathCause.KILLED, True),
        (DeathCause.INIT_FAILED, True),
        (DeathCause.INIT_FAILED, True),
    ], causes
    assert "did not start within startup_timeout_s" in _first_deaths(o)[-1].detail


@pytest.mark.parametrize("lockstep", [False, True])
def test_a_rank_that_never_starts_stays_down_once_its_budget_is_spent(lockstep: bool) -> None:
    o, runtime = (_gang if lockstep else _dense)(max_restarts=2, restart_backoff_s=0)
    runtime.wedged_starts = 100
    o.report(1, DeathCause.KILLED, "SIGKILL")
    _settle(o)
    assert [d.restarting for d in _first_deaths(o)] == [True, True, False]
    assert 1 not in runtime.alive
    assert runtime.alive == (set() if lockstep else {0}), "a dense cluster serves on degraded; a gang stops"


@pytest.mark.parametrize("cause", [DeathCause.HUNG, DeathCause.ENGINE_ERROR, DeathCause.PROCESS_DIED])
def test_a_dense_rank_that_stays_down_is_ended_at_once(cause: DeathCause) -> None:
    """With no restart left, a rank's process must not keep its devices until close(): a hung one, one whose
    step raised, or one that lives on after a worker of it died (a worker's death is the cause reported)."""
    o, runtime = _dense(max_restarts=0)
    o.report(1, cause, "no progress for 2.0s")
    _settle(o)
    assert [d.restarting for d in _first_deaths(o)] == [False]
    assert runtime.alive == {0}, "the rank's process was ended; the other one serves on"
