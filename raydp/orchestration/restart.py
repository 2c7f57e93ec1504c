"""Restarting one dense rank: in its own placement, or re-placed when its node died.

A dense rank serves alone, so it restarts alone while its budget
(``max_restarts`` per rank within ``restart_window_s``, each repeat after an
exponential backoff: :mod:`raydp.orchestration.budget`) lasts: the dead engine is ended and waited for
(its name and resources must be free), a successor is created with the
devices the rank had (or, after a node death, in a new placement on the nodes
that remain, probed afresh), it handshakes, subscribes to the coordinator,
and clients follow it to its new address. A restart that fails (its successor
raised, or wedged past ``startup_timeout_s``) is reported as an
``INIT_FAILED`` death of the rank, and the same policy decides again: another
try after the backoff while the budget lasts, else the rank stays down, and its
process, if it still runs (hung, or its step raised), is ended so that its
devices are free. This is the one restart procedure of both backends.
"""

from __future__ import annotations

import logging

from raydp.errors import DeathCause, engine_death
from raydp.orchestration.controls import Controls
from raydp.orchestration.ranks import RankRecord
from raydp.orchestration.runtime import CoordinatorUnavailableError

logger = logging.getLogger("raydp.manager")


class DenseRestarts:
    """The dense restart policy of one cluster (callers hold the report lock); its budget is ``controls.budget``."""

    def __init__(self, controls: Controls) -> None:
        self.c = controls

    def on_death(self, rank: int, cause: DeathCause, detail: str) -> None:
        """Report the death, restarting the rank on a thread of its own if the policy allows."""
        c = self.c
        if rank not in c.table:
            return  # a rank a scale-down removed meanwhile
        delay = self.may_restart(rank, cause)
        c.reports.died(engine_death(rank, c.table[rank].node_id, cause, detail, delay is not None))
        if delay is not None:
            c.in_background(f"raydp-restart-{rank}", self.restart, rank, cause, delay)
        elif not c.closing():
            # A rank that stays down may still be a process (hung, its step raised, a worker of it died)
            # holding its devices and memory: end it now, as a restart would, rather than at close().
            # Ending one already gone does nothing.
            c.in_background(f"raydp-end-{rank}", c.end_quietly, c.table[rank])

    def may_restart(self, rank: int, cause: DeathCause) -> float | None:
        """The backoff before restarting ``rank``, or None when it stays down."""
        if self.c.closing():
            return None
        if cause is DeathCause.NODE_DIED and not self.c.table[rank].owns_group:
            return None  # the user's own group died with its node: not ours to re-place
        return self.c.budget.take(rank)

    def restart(self, rank: int, cause: DeathCause, delay_s: float = 0.0) -> None:
        """End the old engine, start its successor after ``delay_s``, rejoin it; see the module docstring."""
        c = self.c
        record = c.table[rank]
        try:
            # An engine whose step raised is still alive, holding its name and its
            # resources: it must be gone before its successor can take them.
            c.rt.kill([record])
            if delay_s > 0:
                logger.warning("engine rank %d restarts in %.1fs (backoff)", rank, delay_s)
                if c.owned.stop.wait(delay_s):
                    return  # closing: no successor
            if cause is DeathCause.NODE_DIED:
                record = self.replace(record)
            with c.owned.lock:
                if c.owned.released:
                    return
                c.rt.spawn_engines([record], [record.devices], successors=True)
            coordinator = c.state.coordinator  # what the rank's INIT names
            result = c.rt.join([record], c.init_for)
            now = c.state.coordinator
            if now != coordinator and now is not None:
                c.rt.follow_coordinator([record], now)  # it moved meanwhile
            try:
                c.rt.wait_subscribed(len(c.table), rank, [record])
            except CoordinatorUnavailableError:
                # A successor resyncs this rank itself, and without one a dense rank
                # serves the launcher's clients all the same.
                logger.warning("engine rank %d rejoined while the coordinator is down", rank)
        except Exception as exc:
            c.rt.kill([record])  # never leave a half-started successor
            if not c.closing():  # one more death: the budget decides whether it is tried again
                c.report(rank, DeathCause.INIT_FAILED, f"restart failed: {exc}")
            return
        with c.owned.lock:
            if c.owned.released:
                return
            c.publish_restart([record], result)

    def replace(self, old: RankRecord) -> RankRecord:
        """The rank's node died: a new placement on the nodes that remain (or that join in time)."""
        c = self.c
        with c.place_lock:
            c.rt.remove_groups([old])
            others = [r for r in c.table if r.rank != old.rank]
            (record,) = c.rt.place(range(old.rank, old.rank + 1), others, f"re-placing rank {old.rank}")
            (record.devices,) = c.rt.resolve_devices(c.rt.probe_devices([record]))
            record.restarts = old.restarts
            c.state.replace_rank(record)
        logger.warning(
            "engine rank %d re-placed on node %s (its node %s died)", old.rank, record.node_id[:12], old.node_id[:12]
        )
        return record
