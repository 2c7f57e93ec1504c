"""Restarting a lockstep gang: one rank died, so every rank restarts and the DP group is formed anew.

A lockstep rank cannot be restarted alone: its peers wait for it inside the
collective, and a successor could not join their group. So with a restart
left in the gang's budget (``max_restarts`` within ``restart_window_s``, each
repeat after the doubling backoff, as a dense rank's: :mod:`~raydp.orchestration.budget`),
the first death of a lockstep cluster is reported as
restarting, every peer is reported dead too (their in-flight requests fail
with the typed error, or move where they allow it and nothing streamed yet),
all engines are ended, and the gang is started again in its placements: a new
rendezvous, every rank handshakes and joins the new group in the
coordinator's current wave, and clients follow each rank to its new address.
A restart that fails (a rank's successor raised or wedged while starting) is
one more death of the gang: tried again after the backoff while the budget
lasts. Deaths during the restart, or with no restarts left, end the gang.
"""

from __future__ import annotations

import logging
import time

from raydp.errors import DeathCause, EngineDeadError, engine_death
from raydp.orchestration.budget import RestartBudget
from raydp.orchestration.controls import Controls

logger = logging.getLogger("raydp.manager")


class GangRestarts:
    """The lockstep restart policy of one cluster (callers hold the report lock)."""

    GANG = 0  # the budget's one key: the gang restarts as one

    def __init__(self, controls: Controls, max_restarts: int) -> None:
        self.c = controls
        cfg = controls.config
        self.budget = RestartBudget(
            max_restarts,
            (self.GANG,),
            window_s=cfg.restart_window_s,
            backoff_s=cfg.restart_backoff_s,
            backoff_max_s=cfg.restart_backoff_max_s,
        )
        self.restarting = False
        self.stopped = False  # the gang was stopped for good: its other ranks' ends need no more killing

    def on_death(self, rank: int, cause: DeathCause, detail: str) -> None:
        """A lockstep rank died: restart the gang if the policy allows, else stop every rank."""
        c = self.c
        if self.restarting:
            logger.info("lockstep rank %d ended while its gang restarts (%s)", rank, cause.value)
            return
        if rank not in c.table:
            return
        delay = None if c.closing() else self.budget.take(self.GANG)
        c.reports.died(engine_death(rank, c.table[rank].node_id, cause, detail, delay is not None))
        if delay is None:
            if not self.stopped:
                self.stopped = True
                c.kill_ranks()
            return
        self.restarting = True
        c.in_background("raydp-gang-restart", self.restart, rank, delay)

    def restart(self, first: int, delay_s: float = 0.0) -> None:
        c, started = self.c, time.monotonic()
        records = list(c.table)
        with c.report_lock:
            c.rt.retire(records)  # their ends are this restart's doing, reported here, once
            for record in records:
                if record.rank != first:
                    c.reports.died(
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
            c.rt.kill(records)
            phases.mark("stopped")
            if delay_s > 0:
                logger.warning("lockstep gang restarts in %.1fs (backoff)", delay_s)
                if c.owned.stop.wait(delay_s):
                    return  # closing: no successor
            self.start_again(phases)
        except Exception as exc:
            c.rt.kill(records)  # never leave half a gang started
            if not c.closing():
                logger.error("lockstep gang restart failed: %r", exc)
                with c.report_lock:
                    self.restarting = False
                c.report(first, DeathCause.INIT_FAILED, f"gang restart failed: {exc}")
            return
        logger.warning(
            "lockstep gang of %d ranks restarted in %.2fs (%s)", len(records), time.monotonic() - started, phases
        )

    def start_again(self, phases: Phases) -> None:
        c = self.c
        records = list(c.table)
        with c.owned.lock:
            if c.owned.released:
                return
            state = c.rt.coordinator_state()
            # A wave the old gang was running can never complete: the new one starts in the next,
            # so its first request's StartWave (for a later wave) wakes every rank at once. In the
            # running wave it would step alone until the coordinator's heartbeat repeats the wave.
            c.state.advance_wave(state.wave + (1 if state.running else 0))
            c.rt.spawn_engines(records, [r.devices for r in records], successors=True)
        phases.mark("created")
        c.state.rendezvous_at(c.rt.dp_master(len(records), []))  # the old ranks' runs ended: watch none
        phases.mark("rendezvous")
        result = c.rt.join(records, c.init_for)
        phases.mark("handshake")
        if not c.rt.wait_subscribed(len(records), None, records):
            raise TimeoutError("engines did not subscribe to the coordinator's broadcast in time")
        phases.mark("subscribed")
        with c.owned.lock:
            if c.owned.released:
                return
            with c.report_lock:
                self.restarting = False
            c.publish_restart(records, result)


class Phases:
    """When each step of a restart ended, from its start: its log line shows where the time went."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.ends: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        self.ends.append((phase, time.monotonic() - self.started))

    def __str__(self) -> str:
        return ", ".join(f"{phase} at {end:.2f}s" for phase, end in self.ends)
