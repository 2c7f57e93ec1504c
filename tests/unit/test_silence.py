"""Ranks frozen whole: the coordinator's silence clock, and the watch that ends a silent rank as hung."""

from __future__ import annotations

import threading

import msgspec
import pytest

from raydp.config import RaydpConfig
from raydp.coordinator.silence import Silence
from raydp.coordinator.state import CoordinatorState
from raydp.errors import ConfigError, DeathCause, EngineHungError
from raydp.orchestration.core import Orchestrator
from raydp.orchestration.silence import SilenceWatch
from raydp.wire.control import coordinator_decoder
from raydp.wire.records import CoordinatorStatus
from tests.unit.orchestration_model import ModelCoordinator, ModelRuntime, started

pytestmark = pytest.mark.timeout(60)


def test_a_rank_counts_from_its_first_word_and_afresh_after_a_death() -> None:
    silence = Silence(3)
    assert silence.seconds(100.0) == [0.0, 0.0, 0.0], "nobody has spoken: nobody is silent"
    silence.hear(0, 90.0)
    silence.hear(1, 99.0)
    silence.hear(7, 99.0)  # not a rank: ignored
    assert silence.seconds(100.0) == [10.0, 1.0, 0.0]
    silence.forget(0)  # died, or restarted: its successor has not spoken
    silence.resize(2)
    silence.resize(4)  # a scale-down, then up again: the new ranks have not spoken
    assert silence.seconds(100.0) == [0.0, 1.0, 0.0, 0.0]


def test_the_default_bound_follows_the_step_timeout_and_a_shorter_one_is_refused() -> None:
    assert RaydpConfig(step_timeout_s=10).silence_bound_s == 70.0
    assert RaydpConfig(step_timeout_s=None).silence_bound_s is None
    assert RaydpConfig(step_timeout_s=10, silence_timeout_s=12).silence_bound_s == 12
    with pytest.raises(ConfigError, match=r"silence_timeout_s=5\.0 must be > step_timeout_s=10\.0"):
        RaydpConfig(step_timeout_s=10, silence_timeout_s=5)


class _Silent:
    """The model coordinator's status, with silences the test sets."""

    def __init__(self, runtime: ModelRuntime) -> None:
        self.read = runtime.coordinator_state
        self.silent_s: list[float] = []
        self.hold: str | None = None

    def __call__(self) -> CoordinatorStatus:
        return msgspec.structs.replace(self.read(), silent_s=list(self.silent_s), hold=self.hold)


def _dense(**fields: object) -> tuple[Orchestrator, ModelRuntime, _Silent]:
    coord = CoordinatorState(engine_count=2, stats_interval_s=0.125, heartbeat_interval_s=1.0)
    runtime = ModelRuntime(lambda: coord)
    control = ModelCoordinator(lambda body: coord.handle(coordinator_decoder(body)))
    o = started(2, runtime, control, **fields)
    silent = _Silent(runtime)
    runtime.coordinator_state = silent  # type: ignore[method-assign]
    return o, runtime, silent


def _settle(o: Orchestrator) -> None:
    for thread in list(o.controls.threads):
        thread.join(10)
        assert not thread.is_alive(), "a restart never ended"


def test_a_rank_silent_past_the_bound_is_killed_and_its_end_reported_as_hung() -> None:
    o, runtime, silent = _dense(max_restarts=1, restart_backoff_s=0)
    watch = SilenceWatch(o.controls, bound_s=5.0, scale_lock=threading.Lock())
    silent.silent_s = [0.5, 4.9]
    assert watch.check() == [], "within the bound"
    silent.silent_s = [0.5, 9.25]
    assert watch.check() == [1]
    assert runtime.alive == {0} and o.reports.deaths == [], "killed; its watcher reports the end"
    o.report(1, DeathCause.KILLED, "ray.kill")  # as the rank's watcher reports the kill
    (death,) = o.reports.deaths
    assert isinstance(death, EngineHungError) and death.rank == 1 and death.node_id == "node1"
    assert death.cause is DeathCause.HUNG and death.restarting and death.seconds_without_progress == 9.25
    assert "said nothing for 9.2s" in death.where and "holds the GIL" in str(death)
    _settle(o)
    assert runtime.alive == {0, 1} and o.table[1].restarts == 1, "a successor serves"
    o.report(1, DeathCause.KILLED, "SIGKILL")  # the successor's own end later is what it is
    assert o.reports.deaths[-1].cause is DeathCause.KILLED


def test_a_rank_already_dead_a_held_gang_or_a_scale_change_is_left_alone() -> None:
    o, _, silent = _dense(max_restarts=0)
    scale_lock = threading.Lock()
    watch = SilenceWatch(o.controls, bound_s=5.0, scale_lock=scale_lock)
    silent.silent_s = [0.5, 30.0]
    with scale_lock:
        assert watch.check() == [], "a scale change runs"
    silent.hold = "held"
    assert watch.check() == [], "the gang re-forms its DP group"
    silent.hold = None
    o.report(1, DeathCause.KILLED, "SIGKILL")  # reported dead by its watcher first
    assert watch.check() == [] and len(o.reports.deaths) == 1 and 1 not in o.controls.frozen, "no second end"


def test_a_ticker_holds_its_owner_weakly_and_ends_once_it_is_collected() -> None:
    """The silence watch and the autoscalers tick on such threads: a dropped cluster must still be collected."""
    import gc
    import time
    import weakref

    from raydp.orchestration.controls import tick_while_alive

    class Owner:
        ticked = threading.Event()

    owner = Owner()
    tick_while_alive(owner, lambda o: o.ticked.set(), 0.01, threading.Event(), "raydp-test-ticker")
    assert Owner.ticked.wait(10), "it ticks"
    ref = weakref.ref(owner)
    del owner
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (gc.collect() >= 0 and ref() is not None):
        time.sleep(0.01)  # a tick in progress holds it for that tick only
    assert ref() is None, "the ticking thread kept its owner alive"
    while time.monotonic() < deadline and any(t.name == "raydp-test-ticker" for t in threading.enumerate()):
        time.sleep(0.01)
    assert not any(t.name == "raydp-test-ticker" for t in threading.enumerate()), "the thread ended"
