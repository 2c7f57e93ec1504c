"""Restarting one dense rank: in its own placement, or re-placed when its node died.

A dense rank serves alone, so it restarts alone while its budget
(``max_restarts`` per rank within ``restart_window_s``, each repeat after an
exponential backoff: :mod:`raydp.orchestration.budget`) lasts: the dead engine is ended and waited for
(its name and resources must be free), a successor is created with the
devices the rank had (or, after a node death, in a new placement on the nodes
that remain, probed afresh), it handshakes, subscribes to the coordinator,
and clients follow it to its new address. A restart that fails ends the rank
for good, reported as ``INIT_FAILED``. This is the one restart procedure of
both backends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from raydp.config import RaydpConfig
from raydp.errors import DeathCause, engine_death
from raydp.orchestration.budget import RestartBudget
from raydp.orchestration.ranks import RankRecord
from raydp.orchestration.runtime import CoordinatorUnavailableError

if TYPE_CHECKING:
    from raydp.orchestration.core import Orchestrator

logger = logging.getLogger("raydp.manager")


class DenseRestarts:
    """The dense restart policy of one cluster (callers hold the orchestrator's report lock)."""

    def __init__(self, orchestrator: Orchestrator, config: RaydpConfig) -> None:
        self.o = orchestrator
        self.budget = RestartBudget(  # granted at startup and on scale-ups
            config.max_restarts,
            window_s=config.restart_window_s,
            backoff_s=config.restart_backoff_s,
            backoff_max_s=config.restart_backoff_max_s,
        )

    def on_death(self, rank: int, cause: DeathCause, detail: str) -> None:
        """Report the death, restarting the rank on a thread of its own if the policy allows."""
        o = self.o
        if rank not in o.table:
            return  # a rank a scale-down removed meanwhile
        delay = self.may_restart(rank, cause)
        o.reports.died(engine_death(rank, o.table[rank].node_id, cause, detail, delay is not None))
        if delay is not None:
            o.in_background(f"raydp-restart-{rank}", self.restart, rank, cause, delay)

    def may_restart(self, rank: int, cause: DeathCause) -> float | None:
        """The backoff before restarting ``rank``, or None when it stays down."""
        if self.o.closing():
            return None
        if cause is DeathCause.NODE_DIED and not self.o.table[rank].owns_group:
            return None  # the user's own group died with its node: not ours to re-place
        return self.budget.take(rank)

    def restart(self, rank: int, cause: DeathCause, delay_s: float = 0.0) -> None:
        """End the old engine, start its successor after ``delay_s``, rejoin it; see the module docstring."""
        o = self.o
        record = o.table[rank]
        try:
            # An engine whose step raised is still alive, holding its name and its
            # resources: it must be gone before its successor can take them.
            o.rt.kill([record])
            if delay_s > 0:
                logger.warning("engine rank %d restarts in %.1fs (backoff)", rank, delay_s)
                if o.owned.stop.wait(delay_s):
                    return  # closing: no successor
            if cause is DeathCause.NODE_DIED:
                record = self.replace(record)
            with o.owned.lock:
                if o.owned.released:
                    return
                o.rt.spawn_engines([record], [record.devices], successors=True)
            coordinator = o.coordinator_endpoints  # what the rank's INIT names
            result = o.rt.join([record], o.init_for)
            if o.coordinator_endpoints != coordinator and o.coordinator_endpoints is not None:
                o.rt.follow_coordinator([record], o.coordinator_endpoints)  # it moved meanwhile
            try:
                o.rt.wait_subscribed(len(o.table), rank, [record])
            except CoordinatorUnavailableError:
                # A successor resyncs this rank itself, and without one a dense rank
                # serves the launcher's clients all the same.
                logger.warning("engine rank %d rejoined while the coordinator is down", rank)
        except Exception as exc:
            o.rt.kill([record])  # never leave a half-started successor
            if not o.closing():
                with o.report_lock:
                    self.budget.exhaust(rank)
                o.report(rank, DeathCause.INIT_FAILED, f"restart failed: {exc}")
            return
        with o.owned.lock:
            if o.owned.released:
                return
            o.publish_restart([record], result)

    def replace(self, old: RankRecord) -> RankRecord:
        """The rank's node died: a new placement on the nodes that remain (or that join in time)."""
        o = self.o
        with o.place_lock:
            o.rt.remove_groups([old])
            others = [r for r in o.table if r.rank != old.rank]
            (record,) = o.rt.place(range(old.rank, old.rank + 1), others, f"re-placing rank {old.rank}")
            (record.devices,) = o.rt.resolve_devices(o.rt.probe_devices([record]))
            record.restarts = old.restarts
            o.table.replace(record)
        logger.warning(
            "engine rank %d re-placed on node %s (its node %s died)", old.rank, record.node_id[:12], old.node_id[:12]
        )
        return record
