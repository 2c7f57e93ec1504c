"""Restarting a lockstep gang: one rank died, so every rank restarts and the DP group is formed anew.

A lockstep rank cannot be restarted alone: its peers wait for it inside the
collective, and a successor could not join their group. So with
``max_restarts`` left, the first death of a lockstep cluster is reported as
restarting, every peer is reported dead too (their in-flight requests fail
with the typed error, or move where they allow it and nothing streamed yet),
all engines are ended, and the gang is started again in its placements: a new
rendezvous, every rank handshakes and joins the new group in the
coordinator's current wave, and clients follow each rank to its new address.
Deaths during the restart, or with no restarts left, end the gang.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from raydp.errors import DeathCause, EngineDeadError, engine_death

if TYPE_CHECKING:
    from raydp.orchestration.core import Orchestrator

logger = logging.getLogger("raydp.manager")


class GangRestarts:
    """The lockstep restart policy of one cluster (callers hold the orchestrator's report lock)."""

    def __init__(self, orchestrator: Orchestrator, max_restarts: int) -> None:
        self.o = orchestrator
        self.left = max_restarts
        self.restarting = False
        self.stopped = False  # the gang was stopped for good: its other ranks' ends need no more killing

    def on_death(self, rank: int, cause: DeathCause, detail: str) -> None:
        """A lockstep rank died: restart the gang if the policy allows, else stop every rank."""
        o = self.o
        if self.restarting:
            logger.info("lockstep rank %d ended while its gang restarts (%s)", rank, cause.value)
            return
        if rank not in o.table:
            return
        restarting = self.left > 0 and not o.closing()
        o.reports.died(engine_death(rank, o.table[rank].node_id, cause, detail, restarting))
        if not restarting:
            if not self.stopped:
                self.stopped = True
                o.kill_ranks(except_rank=rank)
            return
        self.left -= 1
        self.restarting = True
        o.in_background("raydp-gang-restart", self.restart, rank)

    def restart(self, first: int) -> None:
        o, started = self.o, time.monotonic()
        records = list(o.table)
        with o.report_lock:
            o.rt.retire(records)  # their ends are this restart's doing, reported here, once
            for record in records:
                if record.rank != first:
                    o.reports.died(
                        EngineDeadError(
                            record.rank,
                            record.node_id,
                            DeathCause.KILLED,
                            f"stopped with its lockstep gang: rank {first} died",
                            restarting=True,
                        )
                    )
        phases = Phases(started)
        try:
            o.rt.kill(records)
            phases.mark("stopped")
            self.start_again(phases)
        except Exception as exc:
            if not o.closing():
                logger.error("lockstep gang restart failed: %r", exc)
                with o.report_lock:
                    self.left, self.restarting = 0, False
                o.report(first, DeathCause.INIT_FAILED, f"gang restart failed: {exc}")
            return
        logger.warning(
            "lockstep gang of %d ranks restarted in %.2fs (%s)", len(records), time.monotonic() - started, phases
        )

    def start_again(self, phases: Phases) -> None:
        o = self.o
        records = list(o.table)
        with o.owned.lock:
            if o.owned.released:
                return
            state = o.rt.coordinator_state()
            # A wave the old gang was running can never complete: the new one starts in the next,
            # so its first request's StartWave (for a later wave) wakes every rank at once. In the
            # running wave it would step alone until the coordinator's heartbeat repeats the wave.
            o.wave = state.wave + (1 if state.running else 0)
            o.rt.spawn_engines(records, [r.devices for r in records], successors=True)
        phases.mark("created")
        o.dp_master = o.rt.dp_master(len(records), [])  # the old ranks' runs ended: watch none of them
        phases.mark("rendezvous")
        result = o.rt.join(records, o.init_for)
        phases.mark("handshake")
        if not o.rt.wait_subscribed(len(records), None, records):
            raise TimeoutError("engines did not subscribe to the coordinator's broadcast in time")
        phases.mark("subscribed")
        with o.owned.lock:
            if o.owned.released:
                return
            with o.report_lock:
                self.restarting = False
            o.publish_restart(records, result)


class Phases:
    """When each step of a restart ended, from its start: its log line shows where the time went."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.ends: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        self.ends.append((phase, time.monotonic() - self.started))

    def __str__(self) -> str:
        return ", ".join(f"{phase} at {end:.2f}s" for phase, end in self.ends)
