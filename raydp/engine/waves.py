"""Engine-side request-wave bookkeeping for lockstep (expert-parallel) ranks.

Pure logic, no sockets and no collectives: the engine loop feeds it events and
acts on what it returns. The rules (``docs/architecture.md``, "Request waves"):

* all ranks share a global state, *running* or *paused*; ``wave`` counts the
  running -> paused transitions and never goes backwards;
* a running rank steps every loop turn, with a dummy batch when it has no work,
  so no peer is left alone in a collective;
* ``interval`` steps into a wave the ranks start an all-reduce of "has
  unfinished work", without waiting for it; a rank collects it at the first
  step at least ``interval`` steps after it started it *and* at which it has
  arrived (a rank whose peer is behind keeps stepping instead of waiting),
  then starts the next one. Only when a result says nobody had work do the
  ranks confirm with a blocking all-reduce of their flags now; when that
  says nobody has any, every rank pauses and moves to ``wave + 1``. Ranks
  may collect at different steps, but they issue the same collectives in
  the same order and act on the same results, so they confirm and pause
  together;
* a request stamped with an older wave reaching a paused rank restarts the
  cluster: the rank reports ``StartWave`` so the coordinator wakes the others;
* a *held* rank (a scale change is re-forming the DP group) starts no wave
  on its own, and the all-reduce of a wave during which anyone was held
  pauses every rank, unfinished work or not (:mod:`raydp.coordinator.hold`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Sync(enum.Enum):
    """What the DP all-reduce does at the end of a step (``None``: nothing, the usual case)."""

    START = "start"  # start one (non-blocking) with this rank's flags
    COLLECT = "collect"  # take the result of the one in flight (it has arrived), then maybe confirm


@dataclass
class EngineWaves:
    """One rank's view of the wave state machine."""

    rank: int
    interval: int = 32
    wave: int = 0
    running: bool = False
    steps: int = 0
    held: bool = False
    pending: bool = False  # a non-blocking all-reduce is in flight
    started_at: int = 0  # the step at which it started
    due: int = 0  # steps from a start to its collect, beyond ``interval``, as the ranks agreed (a pace)
    stopped: bool = False  # a peer's hold ended the wave: start none alone until the coordinator does

    def position(self) -> tuple[int, bool]:
        """What a held rank reports (``HoldAck``): its wave and whether it steps in it."""
        return self.wave, self.running

    def on_request(self, request_wave: int) -> int | None:
        """Note a request's wave; return a wave to report as ``StartWave``, else None."""
        if request_wave > self.wave:
            self.wave = request_wave
            return None
        if request_wave < self.wave and not self.running:
            return self.wave
        return None

    def on_start_wave(self, wave: int) -> None:
        """Handle START_DP_WAVE.

        A late broadcast for a wave this rank already finished is stale: waves
        never go backwards. The message's ``exclude`` needs no case here: the
        excluded rank already has work and steps anyway.
        """
        if wave >= self.wave:
            self.wave = wave
            self.running = True
            self.stopped = False

    def should_step(self, has_local_work: bool) -> bool:
        """Whether the loop should step now (else it waits for input).

        A held rank steps only in a wave the coordinator started: on its own
        it could enter an all-reduce that its regrouping peers never join. So
        does a rank whose wave a peer's hold ended while it still had work
        (the Hold has not reached it yet): nobody else would join it; the
        coordinator starts the next wave on release, or on a new request.
        """
        return self.running or (has_local_work and not self.held and not self.stopped)

    def after_step(self, arrived: Callable[[], bool] = lambda: True) -> Sync | None:
        """Count one step of this wave; say what the all-reduce does at its end, if anything.

        ``arrived`` says whether the one in flight has completed; it is asked
        only once that one is an interval old. This runs every step: with
        near-empty steps its cost is the lockstep tax, hence no enum member
        and no ``max()`` on the way to "nothing" (each costs as much as the
        rest of the method).
        """
        self.running = True
        self.steps += 1
        if self.pending:
            age, interval, due = self.steps - self.started_at, self.interval, self.due
            if age >= (interval if interval > due else due) and arrived():
                return Sync.COLLECT
            return None
        return Sync.START if self.steps % self.interval == 0 else None

    def on_started(self) -> None:
        self.pending = True
        self.started_at = self.steps

    def on_collected(self, global_unfinished: bool, global_hold: bool, pace: int = 0) -> bool:
        """The all-reduce in flight arrived; True when the ranks must confirm now, blocking.

        Work finished (or a hold) an interval ago may not be the whole truth now:
        only a confirmation with the flags of this step may pause the wave.
        ``pace``, the MAX the all-reduce carried, is how many steps the next one
        stays in flight (at least ``interval``): every rank learns the same.
        """
        self.pending = False
        self.due = pace
        return global_hold or not global_unfinished

    def on_allreduce(self, global_unfinished: bool, global_hold: bool = False) -> int | None:
        """Apply the confirming (blocking) all-reduce; return the completed wave if all ranks pause."""
        if global_unfinished and not global_hold:
            return None
        completed = self.wave
        self.running = False
        self.due = 0
        self.stopped = global_hold
        self.wave += 1
        self.steps = 0
        return completed
