"""Restarting one dense rank: in its own placement group, or re-placed when its node died.

A dense rank serves alone, so it restarts alone while its budget
(``max_restarts``, per rank) lasts: the dead actor is killed and waited for
(its name and bundle must be free), a successor is created with the devices
the rank had (or, after a node death, in a new group on the nodes that remain,
probed afresh), it handshakes, subscribes to the coordinator, and clients
follow it to its new address. A restart that fails ends the rank for good,
reported as ``INIT_FAILED``.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import ray

from raydp.actors.slots import probe_devices, replace_slot
from raydp.actors.terminate import kill_and_wait
from raydp.backend import RestartBudget
from raydp.errors import DeathCause, EngineDeadError
from raydp.placement.groups import remove_groups

if TYPE_CHECKING:
    from raydp.actors.manager import ActorManager

logger = logging.getLogger("raydp.manager")


class RankRestarts:
    """The dense restart policy of one manager (the manager's report lock is held by callers)."""

    def __init__(self, manager: ActorManager, max_restarts: int) -> None:
        self.m = manager
        self.budget = RestartBudget(max_restarts)  # granted at startup and on scale-ups

    def on_death(self, rank: int, cause: DeathCause, detail: str) -> None:
        """Report the death, restarting the rank on a thread of its own if the policy allows."""
        m = self.m
        restarting = self._may_restart(rank, cause)
        m._reports.died(EngineDeadError(rank, m.slots[rank].node_id, cause, detail, restarting))
        if restarting:
            thread = threading.Thread(target=self._restart, args=(rank, cause), name=f"raydp-restart-{rank}",
                                      daemon=True)
            m._owned.restarts.append(thread)
            thread.start()

    def _may_restart(self, rank: int, cause: DeathCause) -> bool:
        m = self.m
        if rank >= len(m.slots) or m._owned.stop.is_set():
            return False
        if cause is DeathCause.NODE_DIED and m.slots[rank].group not in m._owned.groups:
            return False  # the user's own group died with its node: not ours to re-place
        return self.budget.take(rank)

    def _restart(self, rank: int, cause: DeathCause) -> None:
        m = self.m
        try:
            # An engine whose step raised is still alive, holding its name and its
            # bundle: it must be gone before its successor can take them.
            kill_and_wait(m._owned.engines[rank])
            if cause is DeathCause.NODE_DIED:
                self._replace_slot(rank)
            with m._owned.lock:
                if m._owned.released:
                    return
                m._start_engines({rank: m._startup.devices[rank]}, successors=True)
            result, refs = m.joining.handshake(m._startup, [rank], {})
            try:
                m.joining.wait_coordinator(refs, len(m.slots), rank)
            except ray.exceptions.RayActorError:
                # The coordinator died meanwhile: a successor resyncs this rank itself, and
                # without one a dense rank serves the launcher's clients all the same.
                logger.warning("engine rank %d rejoined while the coordinator is down", rank)
        except Exception as exc:
            kill_and_wait(m._owned.engines[rank])  # never leave a half-started successor
            if not m._owned.stop.is_set():
                with m._report_lock:
                    self.budget.exhaust(rank)
                m._report(rank, DeathCause.INIT_FAILED, f"restart failed: {exc}")
            return
        with m._owned.lock:
            if m._owned.released:
                return
            m._publish_restart(rank, result, refs)

    def _replace_slot(self, rank: int) -> None:
        """The rank's node died: a new group on the nodes that remain (or that join in time)."""
        m = self.m
        with m._place_lock:  # two ranks of one node must not plan onto the same free devices
            old = m.slots[rank]
            remove_groups([old.group])
            with m._owned.lock:
                m._owned.groups[:] = [g for g in m._owned.groups if g is not old.group]
            slot = replace_slot(m.config, m.slots, rank, m.driver_node_id, m._owned)
            m.slots = tuple(slot if s.rank == rank else s for s in m.slots)
            m._startup.devices[rank] = probe_devices(m.config, [slot])[0]
            m._owned.nodes.add(slot.node_id)
        logger.warning("engine rank %d re-placed on node %s (its node %s died)", rank, slot.node_id[:12],
                       old.node_id[:12])
