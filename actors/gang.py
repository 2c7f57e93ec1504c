"""Restarting a lockstep gang: one rank died, so every rank restarts and the DP group is formed anew.

A lockstep rank cannot be restarted alone: its peers wait for it inside the
collective, and a successor could not join their group. So with
``max_restarts`` left, the first death of a lockstep cluster is reported as
restarting, every peer is reported dead too (their in-flight requests fail
with the typed error, or move where they allow it and nothing streamed yet),
all actors are ended, and the gang is started again in its placement groups:
rank 0 hosts a new rendezvous, every rank handshakes and joins the new group
in the coordinator's current wave, and clients follow each rank to its new
address. Deaths during the restart, or with no restarts left, end the gang
as before.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import ray

from raydp.actors.terminate import kill_and_wait
from raydp.errors import DeathCause, EngineDeadError

if TYPE_CHECKING:
    from raydp.actors.manager import ActorManager

logger = logging.getLogger("raydp.manager")


class GangRestarts:
    """The lockstep restart policy of one manager (the manager's report lock is held by callers)."""

    def __init__(self, manager: ActorManager, max_restarts: int) -> None:
        self.m = manager
        self.left = max_restarts
        self.restarting = False

    def on_death(self, rank: int, cause: DeathCause, detail: str) -> None:
        """A lockstep rank died: restart the gang if the policy allows, else stop every rank."""
        m = self.m
        if self.restarting:
            logger.info("lockstep rank %d ended while its gang restarts (%s)", rank, cause.value)
            return
        restarting = self.left > 0 and not m._owned.stop.is_set()
        m._reports.died(EngineDeadError(rank, m.slots[rank].node_id, cause, detail, restarting))
        if not restarting:
            # The collective is broken: the peers would wait in it forever. Fail the whole gang now.
            m._owned.kill_engines(except_rank=rank)
            return
        self.left -= 1
        self.restarting = True
        thread = threading.Thread(target=self._restart, args=(rank,), name="raydp-gang-restart", daemon=True)
        m._owned.restarts.append(thread)
        thread.start()

    def _restart(self, first: int) -> None:
        m, started = self.m, time.monotonic()
        ranks = list(range(len(m.slots)))
        with m._report_lock:
            for rank in ranks:  # their ends are this restart's doing, reported here, once
                ref = m._startup.run_ref_of.pop(rank, None)
                if ref is not None:
                    m._retired_refs.add(ref)
            for rank in ranks:
                if rank != first:
                    m._reports.died(EngineDeadError(
                        rank, m.slots[rank].node_id, DeathCause.KILLED,
                        f"stopped with its lockstep gang: rank {first} died", restarting=True,
                    ))
        try:
            engines = [m._owned.engines[rank] for rank in ranks]
            for actor in engines:  # all at once, then wait: their names and bundles must be free
                ray.kill(actor, no_restart=True)
            for actor in engines:
                kill_and_wait(actor)
            phases = _Phases(started)
            phases.mark("stopped")
            self._start_again(ranks, phases)
        except Exception as exc:
            if not m._owned.stop.is_set():
                logger.error("lockstep gang restart failed: %r", exc)
                with m._report_lock:
                    self.left, self.restarting = 0, False
                m._report(first, DeathCause.INIT_FAILED, f"gang restart failed: {exc}")
            return
        logger.warning("lockstep gang of %d ranks restarted in %.2fs (%s)", len(ranks), time.monotonic() - started,
                       phases)

    def _start_again(self, ranks: list[int], phases: _Phases) -> None:
        m, startup = self.m, self.m._startup
        with m._owned.lock:
            if m._owned.released:
                return
            state = m.coordinator_state()
            # A wave the old gang was running can never complete: the new one starts in the next,
            # so its first request's StartWave (for a later wave) wakes every rank at once. In the
            # running wave it would step alone until the coordinator's heartbeat repeats the wave.
            startup.wave = int(state["wave"]) + (1 if state["running"] else 0)
            m._start_engines({rank: startup.devices[rank] for rank in ranks}, successors=True)
        phases.mark("created")
        coordinator = {ref: r for ref, r in startup.run_refs.items() if r < 0}  # the old ranks' refs ended
        startup.dp_master = m.joining.dp_master(startup, coordinator)
        phases.mark("rendezvous")
        result, refs = m.joining.handshake(startup, ranks, {})
        phases.mark("handshake")
        m.joining.wait_coordinator(refs, len(ranks))
        phases.mark("subscribed")
        with m._owned.lock:
            if m._owned.released:
                return
            with m._report_lock:
                self.restarting = False
            for rank in ranks:
                rank_refs = {ref: r for ref, r in refs.items() if r == rank}
                m._publish_restart(rank, result, rank_refs)


class _Phases:
    """When each step of a restart ended, from its start: its log line shows where the time went."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.ends: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        self.ends.append((phase, time.monotonic() - self.started))

    def __str__(self) -> str:
        return ", ".join(f"{phase} at {end:.2f}s" for phase, end in self.ends)
