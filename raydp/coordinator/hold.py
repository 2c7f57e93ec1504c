"""Holding a lockstep gang at a wave boundary while its DP group is re-formed (a scale change).

Pure logic, no sockets. The danger it guards against is a rank waiting in the
old group's all-reduce while its peers have left for the new group: that
hangs both. So the coordinator freezes the gang before anyone regroups:

1. ``HoldCluster`` makes the coordinator broadcast ``Hold``. A held rank
   starts no wave on its own and reports its position (``HoldAck``) whenever
   it changes. A running rank keeps stepping; its all-reduce carries the hold
   flag, so every rank of the wave pauses at the same step, work or not.
2. A rank that acks *running* may be stepping alone (it started before the
   hold reached it): the coordinator wakes the whole gang into that wave so
   the all-reduce completes, and then waits for everyone to pause past it.
   A wave start asked for by a client or an engine meanwhile is treated the
   same way: its target may be stepping alone, already waiting in the
   all-reduce where it cannot read the Hold to ack it.
3. The gang is *frozen* once every rank acked paused in one wave past any
   wave the coordinator woke: nobody steps, nobody will; wave starts asked
   for from here on are deferred. Only then does ``RegroupCluster`` go out
   as ``Regroup``; ranks answer ``Regrouped``.
4. ``ReleaseCluster`` ends the hold; a deferred start (or queued work) starts
   the next wave at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raydp.wire.control import Hold, HoldAck, Regroup, Release


@dataclass
class GangHold:
    """One hold of a lockstep gang of ``engine_count`` ranks, identified by ``epoch``."""

    epoch: int
    engine_count: int
    woke_wave: int = -1  # the latest wave the coordinator started during the hold
    acks: dict[int, tuple[int, bool]] = field(default_factory=dict)  # rank -> (wave, running)
    deferred_start: bool = False
    regroup: Regroup | None = None
    regrouped: set[int] = field(default_factory=set)

    def hold_message(self) -> Hold:
        return Hold(self.epoch)

    def on_ack(self, msg: HoldAck) -> int | None:
        """Record a rank's position; return a wave the whole gang must be woken into, if any."""
        if msg.epoch != self.epoch or not 0 <= msg.rank < self.engine_count:
            return None  # a rank added by this change is not part of the held gang
        self.acks[msg.rank] = (msg.wave, msg.running)
        if msg.running and msg.wave > self.woke_wave:
            self.woke_wave = msg.wave
            return msg.wave
        return None

    def frozen_wave(self) -> int | None:
        """The wave every rank is paused in, once the gang is frozen; else None."""
        if self.regroup is not None or len(self.acks) < self.engine_count:
            return None
        positions = {self.acks.get(r) for r in range(self.engine_count)}
        if len(positions) != 1:
            return None
        wave, running = positions.pop() or (-1, True)
        return wave if not running and wave > self.woke_wave else None

    def start_regroup(self, dp_size: int, dp_master: str) -> Regroup | None:
        wave = self.frozen_wave()
        if wave is None:
            return None
        self.regroup = Regroup(self.epoch, dp_size, dp_master, wave)
        return self.regroup

    def on_regrouped(self, rank: int, epoch: int) -> None:
        if self.regroup is not None and epoch == self.epoch and 0 <= rank < self.engine_count:
            self.regrouped.add(rank)

    def phase(self) -> str:
        """``holding`` -> ``frozen`` -> ``regrouping`` -> ``regrouped``, for the launcher and operators."""
        if self.regroup is None:
            return "frozen" if self.frozen_wave() is not None else "holding"
        # Every rank of the held gang answers: those below the new size joined, the rest left.
        return "regrouped" if len(self.regrouped) >= self.engine_count else "regrouping"

    def unacked(self) -> bool:
        return len(self.acks) < self.engine_count

    def release(self) -> Release:
        return Release(self.epoch)
