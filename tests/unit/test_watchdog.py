"""The progress watchdog: a loop turn past step_timeout_s is a hang, named by its stack; a slow turn is not."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from raydp.engine.watchdog import TurnClock, run_watched
from raydp.errors import DeathCause, EngineDeadError, EngineHungError, engine_death

pytestmark = pytest.mark.timeout(30)


def _hung(seconds: float, where: str) -> EngineHungError:
    return EngineHungError(3, "node-abcdef123456", seconds, where)


def _stuck_in_here(release: threading.Event) -> None:
    release.wait()


def test_a_turn_past_the_timeout_raises_the_hang_with_the_stuck_frame() -> None:
    clock, release = TurnClock(), threading.Event()
    started = time.monotonic()
    with pytest.raises(EngineHungError) as info:
        run_watched(lambda: _stuck_in_here(release), clock, 0.4, _hung, "test-loop")
    release.set()
    assert time.monotonic() - started >= 0.4  # never before the timeout (the test's own timeout bounds after)
    assert info.value.seconds_without_progress > 0.4
    assert "_stuck_in_here" in info.value.where
    assert info.value.rank == 3 and info.value.cause is DeathCause.HUNG


def test_turns_that_each_end_within_the_timeout_are_never_a_hang() -> None:
    clock = TurnClock()

    def slow_loop() -> None:
        for _ in range(15):
            clock.turn_started = time.monotonic()
            time.sleep(0.1)  # 1.5 s in all, past the timeout; each turn 0.9 s inside it, for a busy machine
            clock.steps += 1

    run_watched(slow_loop, clock, 1.0, _hung, "test-loop")
    assert clock.steps == 15


class _Round:
    round_started: float | None = None


def test_a_round_the_peers_never_join_is_a_hang_though_the_loop_turns_on() -> None:
    """A lockstep rank spins (dummy steps) waiting for an all-reduce round; past the timeout that is a hang."""
    clock, peers, stop = TurnClock(), _Round(), threading.Event()
    clock.peers = peers

    def spinning_loop() -> None:
        peers.round_started = time.monotonic()  # started, and never collected: no peer joins it
        while not stop.is_set():
            clock.turn_started = time.monotonic()
            time.sleep(0.01)

    with pytest.raises(EngineHungError) as info:
        run_watched(spinning_loop, clock, 0.4, _hung, "test-loop")
    stop.set()
    assert info.value.seconds_without_progress > 0.4
    assert "waiting for a DP all-reduce round its peers never joined" in info.value.where
    assert "spinning_loop" in info.value.where


def test_rounds_collected_within_the_timeout_are_never_a_hang() -> None:
    clock, peers = TurnClock(), _Round()
    clock.peers = peers

    def stepping_loop() -> None:
        for _ in range(15):
            clock.turn_started = peers.round_started = time.monotonic()  # each round collected by the next
            time.sleep(0.1)  # 1.5 s in all, past the timeout; each round 0.9 s inside it
        peers.round_started = None

    run_watched(stepping_loop, clock, 1.0, _hung, "test-loop")


def test_the_loops_own_error_is_raised_and_none_disables_the_watch() -> None:
    def fails() -> None:
        raise RuntimeError("engine fault")

    with pytest.raises(RuntimeError, match="engine fault"):
        run_watched(fails, TurnClock(), None, _hung, "test-loop")


def test_the_hang_travels_as_text_and_comes_back_typed() -> None:
    where = '  File "/x/raydp/testing/hangs.py", line 29, in block_forever\n    time.sleep(3600)\n'
    error = EngineHungError(1, "abcdef1234567890", 12.5, where, restarting=True)
    assert str(error) == (
        "engine rank 1 on node abcdef123456 hung: no progress for 12.5s, "
        "stuck in block_forever (hangs.py:29); restarting it"
    )
    again = engine_death(1, "abcdef1234567890", DeathCause.HUNG, f"rank 1 pid 7: {error.detail}", True)
    assert isinstance(again, EngineHungError)
    assert (again.seconds_without_progress, again.where.strip(), again.restarting) == (12.5, where.strip(), True)
    assert isinstance(pickle.loads(pickle.dumps(error)), EngineHungError)
    plain = engine_death(1, None, DeathCause.HUNG, "reported by the coordinator")
    assert type(plain) is EngineDeadError and plain.cause is DeathCause.HUNG
