"""Restarting a dead coordinator on its node, at its addresses.

The coordinator's state dies with it, but nothing else has to: the engines
keep serving (dense) or stepping the wave they are in (lockstep), and clients
in the launching process keep routing on their last snapshot. The successor
is the same named actor on the same node, bound to the same IPC paths and TCP
ports, so every engine's and client's ZMQ socket reconnects on its own and
messages sent meanwhile wait in their queues. It gets what only the launcher
knows (:class:`~raydp.coordinator.resync.Restored`) as an argument and
relearns loads and the wave from the engines (:mod:`raydp.coordinator.resync`).

A coordinator whose node died cannot come back at its addresses, and is not
restarted (its node is rank 0's, so that rank is being re-placed too). Neither
is one past ``coordinator_max_restarts``. Then the cluster reports it dead for
good: lockstep ranks stop, dense ranks keep serving the launching process's
clients on their last snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import ray

from raydp.actors.terminate import kill_and_wait
from raydp.coordinator.resync import Restored
from raydp.errors import CoordinatorDeadError, DeathCause
from raydp.wire.endpoints import CoordinatorEndpoints

if TYPE_CHECKING:
    from raydp.actors.manager import ActorManager

logger = logging.getLogger("raydp.manager")


class CoordinatorRestarts:
    """The coordinator's restart policy for one manager (callers hold the manager's report lock)."""

    def __init__(self, manager: ActorManager, max_restarts: int) -> None:
        self.m = manager
        self.left = max_restarts

    def on_death(self, cause: DeathCause, detail: str) -> None:
        m = self.m
        coord = m._startup.coordinator_endpoints
        restarting = (
            self.left > 0 and cause is not DeathCause.NODE_DIED and coord is not None
            and m.endpoints is not None and not m._owned.stop.is_set()
        )
        node = coord.node_id if coord is not None else None
        m._reports.died(CoordinatorDeadError(f"of cluster {m.config.name!r}", node, cause, detail, restarting))
        if not restarting:
            if m.config.lockstep:  # no wave could start again: the ranks would wait forever
                m._owned.kill_engines(except_rank=-1)
            return
        self.left -= 1
        thread = threading.Thread(target=self._restart, name="raydp-coordinator-restart", daemon=True)
        m._owned.restarts.append(thread)
        thread.start()

    def _restart(self) -> None:
        m, started = self.m, time.monotonic()
        try:
            kill_and_wait(m._owned.coordinator)  # it may be wedged rather than dead; its name must be free
            endpoints, restored = self._successor_of()
            with m._owned.lock:
                if m._owned.released:
                    return
                actor = m._create_coordinator(successor_of=(endpoints, restored))
            self._serve(actor, restored.engine_count - len(restored.dead))
        except Exception as exc:
            if m._owned.stop.is_set():
                return
            logger.error("the coordinator of cluster %r could not be restarted: %r", m.config.name, exc)
            with m._report_lock:
                self.left = 0
            m._report(-1, DeathCause.INIT_FAILED, f"restart failed: {exc!r}")
            return
        logger.warning("coordinator of cluster %r restarted in %.2fs", m.config.name, time.monotonic() - started)

    def _successor_of(self) -> tuple[CoordinatorEndpoints, Restored]:
        m = self.m
        assert m.endpoints is not None and m._startup.coordinator_endpoints is not None
        reports, n = m._reports, len(m.slots)
        with m._report_lock:
            dead = {r: c for r, c in reports.dead.items() if r < n}
            restored = Restored(
                engine_count=n,
                size=n,
                dead=dead,
                moved={ep.rank: list(ep.input_addresses) for ep in m.endpoints.engines if ep.rank not in dead},
                nodes={ep.rank: ep.node_id for ep in m.endpoints.engines},
                deaths=[reports.death_counts.get(r, 0) for r in range(n)],
                restarts=[reports.restart_counts.get(r, 0) for r in range(n)],
            )
        return m._startup.coordinator_endpoints, restored

    def _serve(self, actor: Any, live: int) -> None:
        """Check the successor's addresses, watch it, wait for the engines, hand it the cluster."""
        m, cfg = self.m, self.m.config
        old = m._startup.coordinator_endpoints
        new = ray.get(actor.endpoints.remote(), timeout=cfg.startup_timeout_s)
        if new != old:
            raise RuntimeError(f"the successor bound {new}, not its predecessor's {old}")
        ref = actor.run.remote()
        m._owned.run_refs.append(ref)
        m._watch_queue.put((ref, -1))
        waited = actor.wait_for_engines.remote(live, cfg.handshake_timeout_s)
        if not ray.get(waited, timeout=cfg.handshake_timeout_s + 5):
            logger.warning("restarted coordinator: not every live engine resubscribed within %.0fs",
                           cfg.handshake_timeout_s)
        m._hand_cluster(actor)

