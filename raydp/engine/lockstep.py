"""One lockstep rank's part of the protocol: waves, the DP all-reduce, holds and regroups.

The engine loop owns the sockets and the user's engine; this object owns
what only lockstep ranks do, so the loop reads the same in both modes:

* requests and ``StartDPWave`` move the rank's wave (:class:`~raydp.engine.waves.EngineWaves`);
* the ranks keep one non-blocking all-reduce of two flags, "has unfinished
  work" and "is held", in flight: started ``allreduce_interval`` steps into
  a wave, collected once it is an interval old *and* has arrived (a rank
  never waits for a peer that is behind: it keeps stepping), then started
  again; where the engine's forward pass all-reduces over the group too
  (``attach_dp_group`` did not return False), the ranks step together and
  each collects at the step it is due, waiting if need be, since a rank
  confirming a step before its peers would pair its all-reduce with theirs.
  The interval is ``allreduce_interval`` steps, or more: each all-reduce
  also carries how many steps make ``min_interval_s`` at the rank's own
  pace, and the next one stays in flight for the MAX of those (with
  near-empty steps, 32 steps would mean thousands of all-reduces a second).
  The ranks agree on it, never on a clock, for the same reason. When
  one says nobody had work, or anybody was held, they confirm with a
  blocking all-reduce of their flags now, and the wave completes when that
  says nobody has work, or anybody is held;
* ``Hold`` stops the rank starting waves on its own; it reports its position
  (``HoldAck``) whenever it changes, so the coordinator can tell when the
  whole gang is paused (:mod:`raydp.coordinator.hold`);
* ``Regroup`` is applied only while paused: leave the old DP group and join
  the new one (blocking until every member has joined), or, for a rank above
  the new size, just leave; then ``Regrouped``;
* ``Release`` ends the hold.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from raydp.engine.collective import DPCollective
from raydp.engine.waves import EngineWaves, Sync
from raydp.wire.control import (
    Hold,
    HoldAck,
    Regroup,
    Regrouped,
    Release,
    StartDPWave,
    StartWave,
    ToEngines,
    WaveComplete,
)

logger = logging.getLogger("raydp.engine.core")
MAX_PACE = 1_000_000  # steps an all-reduce may stay in flight, whatever the pace (it travels as int32)
Send = Callable[[Any], object]  # a message to the coordinator (what it returns is not looked at)
JoinGroup = Callable[[Regroup], DPCollective]  # leave nothing behind; block until the group is formed


class LockstepRank:
    """Driven by the engine loop; ``send`` reaches the coordinator, ``join`` forms a new DP group."""

    def __init__(
        self,
        rank: int,
        waves: EngineWaves,
        collective: DPCollective | None,
        send: Send,
        join: JoinGroup | None = None,
        attach: Callable[[Any], object] | None = None,
        min_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank, self.waves, self.collective = rank, waves, collective
        self._send, self._join, self._attach = send, join, attach
        self._min_interval_s, self._clock = min_interval_s, clock
        self._paced_at = (0, 0.0)  # (wave step, time) of the last start: the pace is measured from there
        self._epoch = -1
        self._pending: Regroup | None = None
        self._acked: tuple[int, bool] | None = None
        self.retired = False  # above the new size after a scale-down: never steps again
        self.round_started: float | None = None  # the all-reduce in flight, for the watchdog (PeerWait)
        # Whether the engine's forward pass runs collectives over the group: then
        # the ranks step together, and each must collect at the agreed step.
        self._in_step = False
        if collective is not None and attach is not None:
            self._in_step = attach(collective.group) is not False

    def on_request(self, request_wave: int) -> None:
        start = self.waves.on_request(request_wave)
        if start is not None:
            self._send(StartWave(rank=self.rank, wave=start))

    def on_broadcast(self, msg: ToEngines) -> None:
        if isinstance(msg, StartDPWave):
            if not self.retired:
                self.waves.on_start_wave(msg.wave)
        elif isinstance(msg, Hold):
            self._on_hold(msg.epoch)
        elif isinstance(msg, Regroup):
            self._on_regroup(msg)
        elif isinstance(msg, Release) and msg.epoch == self._epoch:
            self.waves.held = False
            self._pending = None

    def should_step(self, has_local_work: bool) -> bool:
        return not self.retired and self.waves.should_step(has_local_work)

    def after_step(self, has_unfinished: bool) -> None:
        """Count the step; once the all-reduce in flight has arrived, collect it, maybe confirm
        and pause, and start the next."""
        sync = self.waves.after_step(self._collectable)
        if sync is not None:
            assert self.collective is not None, "lockstep needs a DP collective"
            if sync is Sync.COLLECT:
                flags = self.collective.collect()
                self.round_started = None
                if self.waves.on_collected(*flags, pace=self.collective.last_pace):
                    self._confirm(has_unfinished)
            if self.waves.running:  # the wave goes on: keep one all-reduce in flight
                self.collective.start(has_unfinished, self.waves.held, self._pace())
                self.round_started = time.monotonic()
                self.waves.on_started()
        if self.waves.held:  # what tick() checks first; this runs every step
            self.tick()

    def _collectable(self) -> bool:
        """Asked once the all-reduce in flight is due: may this step collect it?

        Ranks that step together (the engine all-reduces every step) collect
        at the step it is due, waiting if it has not arrived (it has had an
        interval of collectives after it to do so): were one to collect a step
        before its peers, its confirmation would pair with their forward
        pass's all-reduce. Ranks that do not step together take it only once
        it has arrived, so one never waits for a peer that is behind.
        """
        if self.collective is None:
            return False
        return self._in_step or self.collective.arrived()

    def _pace(self) -> int:
        """Steps that take ``min_interval_s`` at this rank's pace since the last start (0: unknown)."""
        steps, now = self.waves.steps, self._clock()
        (last_steps, last_s), self._paced_at = self._paced_at, (steps, now)
        if self._min_interval_s <= 0 or steps <= last_steps or now <= last_s:
            return 0  # a new wave counts steps from 0 again
        return min(MAX_PACE, math.ceil(self._min_interval_s * (steps - last_steps) / (now - last_s)))

    def _confirm(self, has_unfinished: bool) -> None:
        assert self.collective is not None
        completed = self.waves.on_allreduce(*self.collective.sync(has_unfinished, self.waves.held))
        if completed is not None and self.rank == 0:
            self._send(WaveComplete(rank=0, wave=completed))

    def tick(self) -> None:
        """Once per loop turn: report a changed position, apply a regroup once paused."""
        if not self.waves.held:
            return
        if self._pending is not None and not self.waves.running:
            self._regroup(self._pending)
        self._ack()

    # ---- holds and regroups --------------------------------------------------------

    def _on_hold(self, epoch: int) -> None:
        if epoch < self._epoch:
            return  # a stale repeat of an earlier change
        if epoch > self._epoch:
            self._epoch, self._pending = epoch, None
        self.waves.held = True
        self._acked = None  # answer every Hold: the coordinator repeats it until all have
        self._ack()

    def _on_regroup(self, msg: Regroup) -> None:
        if self.collective is not None and self.collective.master == msg.dp_master:
            self._send(Regrouped(self.rank, msg.epoch))  # joined it already (a rank added by this change)
            return
        if msg.epoch != self._epoch or not self.waves.held:
            logger.warning("rank %d: ignored a regroup of epoch %d while not held for it", self.rank, msg.epoch)
            return
        self._pending = msg
        self.tick()

    def _regroup(self, msg: Regroup) -> None:
        self._pending = None
        if self.collective is not None:
            self.collective.close()
            self.collective = None
        if self.rank >= msg.dp_size:
            self.retired = True
            logger.info("rank %d: left the DP group (the cluster shrinks to %d)", self.rank, msg.dp_size)
        else:
            assert self._join is not None, "a lockstep rank needs a way to join a DP group"
            self.collective = self._join(msg)
            self.waves.wave = max(self.waves.wave, msg.wave)
            if self._attach is not None:
                self._in_step = self._attach(self.collective.group) is not False
            logger.info("rank %d: joined the DP group of %d ranks at %s", self.rank, msg.dp_size, msg.dp_master)
        self._send(Regrouped(self.rank, msg.epoch))

    def _ack(self) -> None:
        position = self.waves.position()
        if position != self._acked and not self.retired:
            self._acked = position
            self._send(HoldAck(self.rank, self._epoch, *position))
