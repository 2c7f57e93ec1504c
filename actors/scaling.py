"""Growing and shrinking a running cluster (``cluster.scale``) on the Ray backend.

A :class:`Scaler` runs one change for an :class:`~raydp.actors.manager.ActorManager`,
in the calling thread. Ranks stay dense (``0..dp_size-1``): a scale-up adds
the next ranks, a scale-down removes the highest.

Scale-up: plan the new ranks on what is free now (waiting for pending
capacity where allowed, :func:`~raydp.actors.slots.place_more`), probe their
devices, tell the coordinator to track them (clients do not route to them
yet), create their actors, run the same handshake as at launch, wait for
their subscriptions, announce their addresses (``EngineRevived`` with the
node), and only then let clients route to them (``ScaleEngines``). Any
failure removes what it made; the cluster serves on at its old size.

Scale-down: clients stop routing to the highest ranks (the launching
process's clients at once, the others from the next snapshot); retryable
requests with no output yet move off them; the rest drain, bounded by
``drain_timeout_s``. Then the ranks are retired (their ends are not deaths),
clients drop them (what is still on them fails with
:class:`~raydp.errors.ScaleDownError`), and their actors and groups go.

Lockstep: before the DP group changes the gang is held at a wave boundary
(:mod:`raydp.coordinator.hold`), rank 0 opens a new rendezvous, every rank
re-forms the group at the new size, and the hold is released; requests that
arrive meanwhile wait in the engines and run after it.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
import ray

from raydp.actors.slots import place_more, start_device_probes
from raydp.actors.terminate import kill_and_wait
from raydp.errors import DeathCause, StartupError
from raydp.placement.groups import remove_groups
from raydp.wire.endpoints import ClusterEndpoints, EngineEndpoint

if TYPE_CHECKING:
    from raydp.actors.manager import ActorManager

logger = logging.getLogger("raydp.manager")
POLL_S = 0.02
_epochs = itertools.count(1)


class Scaler:
    """One scale change of ``manager``'s cluster (the manager serialises them)."""

    def __init__(self, manager: ActorManager) -> None:
        self.m = manager
        self.cfg = manager.config
        coordinator = manager._reports.coordinator
        assert coordinator is not None and manager.endpoints is not None, "scale() needs a started cluster"
        self.coordinator = coordinator

    def scale(self, dp_size: int, drain_timeout_s: float) -> ClusterEndpoints:
        before, started = self.m.dp_size, time.monotonic()
        if dp_size > before:
            self._grow(before, dp_size)
        elif dp_size < before:
            self._shrink(before, dp_size, drain_timeout_s)
        logger.info(
            "cluster %r scaled from %d to %d ranks in %.2fs%s", self.cfg.name, before, dp_size,
            time.monotonic() - started, " (lockstep: the DP group was re-formed)" if self.cfg.lockstep else "",
        )
        assert self.m.endpoints is not None
        return self.m.endpoints

    # ---- scale-up ---------------------------------------------------------------------

    def _grow(self, n: int, m: int) -> None:
        manager, startup = self.m, self.m._startup
        new_slots = place_more(self.cfg, manager.slots, m, manager.driver_node_id, manager._owned)
        new = list(range(n, m))
        regrouping = False
        try:
            manager.slots = (*manager.slots, *new_slots)
            manager._owned.nodes.update(s.node_id for s in new_slots)
            probes = start_device_probes(self.cfg, new_slots)  # resolved by the new ranks as they start
            manager._start_engines(dict(zip(new, probes, strict=True)), successors=True)
            # Built before any hold: a lockstep gang is held only while its group re-forms.
            engines = manager._owned.engines
            ray.get([engines[r].wait_for_init.remote() for r in new], timeout=self.cfg.startup_timeout_s)
            startup.devices += [probe.resolve(self.cfg.startup_timeout_s) for probe in probes]
            if self.cfg.lockstep:
                epoch = self._hold(n)
            self._tell_size(m, n)
            if self.cfg.lockstep:
                regrouping = True
                self._regroup(epoch, m)
            startup.dp_size = m
            result, refs = manager.joining.handshake(startup, new, {})
            manager.joining.wait_coordinator(refs, m)
            if self.cfg.lockstep:
                self._wait_phase("regrouped")
                self.coordinator.release(epoch)
        except BaseException as exc:
            self._undo_grow(n, new, exc, regrouping)
            raise
        self._commit_grow(n, m, result, refs)

    def _commit_grow(self, n: int, m: int, result: Any, refs: dict[Any, int]) -> None:
        manager = self.m
        added = [EngineEndpoint(r, manager.slots[r].node_id, result.ready[r].input_addresses) for r in range(n, m)]
        for ep in added:
            self.coordinator.engine_revived(ep.rank, ep.input_addresses, ep.node_id)
        self._tell_size(m, m)
        manager._rank_restarts.budget.grant(range(n, m))
        for ref, rank in refs.items():
            manager._watch_queue.put((ref, rank))
        self._publish([*self._endpoints().engines, *added], m, None)

    def _undo_grow(self, n: int, new: list[int], exc: BaseException, regrouping: bool) -> None:
        manager, startup = self.m, self.m._startup
        if regrouping:  # the old ranks may be waiting in a group that never forms: the gang is lost
            manager._report(0, DeathCause.INIT_FAILED, f"scale failed while re-forming the DP group: {exc!r}")
            return
        self._retire(new)
        self._stop_ranks(new)
        startup.dp_size = n
        try:
            self._tell_size(n, n)
        except Exception as undo:  # the coordinator is gone too: its death is reported on its own
            logger.error("scale: could not restore the coordinator's size: %r", undo)
        logger.error("scale to %d ranks failed; the cluster serves on with %d: %r", n + len(new), n, exc)

    # ---- scale-down -------------------------------------------------------------------

    def _shrink(self, n: int, m: int, drain_timeout_s: float) -> None:
        gone = list(range(m, n))
        self._tell_size(n, m)
        self._publish(self._endpoints().engines, m, None)
        self._drain(gone, drain_timeout_s)
        if self.cfg.lockstep:
            epoch = self._hold(n)
            self._regroup(epoch, m)
            self._wait_phase("regrouped")
            self.coordinator.release(epoch)
        self._retire(gone)
        self.m._startup.dp_size = m
        self._tell_size(m, m)
        self._publish(self._endpoints().engines[:m], m, drain_timeout_s)
        self._stop_ranks(gone)

    def _drain(self, ranks: list[int], timeout_s: float) -> None:
        """Wait until nothing is in flight on ``ranks``, or ``timeout_s`` passes.

        At least a few stats intervals pass first, so that clients in other
        processes have seen the new size and what they sent just before it
        has arrived.
        """
        started = time.monotonic()
        settle = started + 2 * self.cfg.stats_interval_s + 0.05
        while True:
            left = self._in_flight(ranks)
            now = time.monotonic()
            if left == 0 and now >= settle:
                return
            if now - started >= timeout_s:
                logger.warning("scale-down: %d requests still on ranks %s after the %gs drain timeout; "
                               "they fail with ScaleDownError", left, ranks, timeout_s)
                return
            time.sleep(POLL_S * 2)

    def _in_flight(self, ranks: list[int]) -> int:
        engines = self.m._owned.engines
        refs = [engines[r].counters.remote() for r in ranks]
        total = 0
        for ref in refs:
            try:
                c = ray.get(ref, timeout=10)
            except Exception:  # a dead rank holds nothing any more
                continue
            total += c["added"] - c["finished"] - c["aborted"]
        return total

    # ---- shared steps -----------------------------------------------------------------

    def _retire(self, ranks: list[int]) -> None:
        """From here on, the ends of ``ranks`` are a scale-down, not deaths to report or restart."""
        manager = self.m
        with manager._report_lock:
            for rank in ranks:
                ref = manager._startup.run_ref_of.pop(rank, None)
                if ref is not None:
                    manager._retired_refs.add(ref)
                manager._rank_restarts.budget.forget(rank)

    def _stop_ranks(self, ranks: list[int]) -> None:
        """End the actors of ``ranks`` (the highest ranks) and remove their groups."""
        manager, owned = self.m, self.m._owned
        actors = [owned.engines[r] for r in ranks if r < len(owned.engines)]
        refs = [a.shutdown.remote() for a in actors]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=3.0)
        for actor in actors:
            kill_and_wait(actor)
        first = min(ranks)
        groups = [s.group for s in manager.slots[first:] if s.group in owned.groups]
        remove_groups(groups)
        with owned.lock:
            owned.groups[:] = [g for g in owned.groups if g not in groups]
            del owned.engines[first:]
        manager.slots = manager.slots[:first]
        del manager._startup.devices[first:]
        for rank in ranks:
            manager._startup.capacity.pop(rank, None)

    def _tell_size(self, engine_count: int, size: int) -> None:
        """Tell the coordinator, and wait until it has applied it (its PUSH is fire-and-forget)."""
        self.coordinator.scale(engine_count, size)
        self._wait_state(lambda s: s["dp_size"] == engine_count and s["routable"] == size,
                         f"the coordinator to track {engine_count} ranks")

    def _hold(self, gang: int) -> int:
        epoch = next(_epochs)
        self.coordinator.hold(epoch, gang)
        self._wait_phase("frozen")
        return epoch

    def _regroup(self, epoch: int, dp_size: int) -> None:
        master = ray.get(self.m._owned.engines[0].dp_master.remote(dp_size), timeout=30)
        state = self.m.coordinator_state()
        self.m._startup.wave, self.m._startup.dp_master = state["wave"], master
        self.coordinator.regroup(epoch, dp_size, master)
        self._wait_state(lambda s: s["hold"] in ("regrouping", "regrouped"), "the coordinator to start the regroup")

    def _wait_phase(self, phase: str) -> None:
        self._wait_state(lambda s: s["hold"] == phase, f"the lockstep gang to be {phase}")

    def _wait_state(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + self.cfg.handshake_timeout_s
        while not done(self.m.coordinator_state()):
            if self.m._owned.stop.is_set():
                raise StartupError(f"cluster {self.cfg.name!r} is closing")
            if time.monotonic() > deadline:
                raise StartupError(f"scale: timed out after {self.cfg.handshake_timeout_s:g}s waiting for {what}")
            time.sleep(POLL_S)

    def _endpoints(self) -> ClusterEndpoints:
        assert self.m.endpoints is not None
        return self.m.endpoints

    def _publish(self, engines: list[EngineEndpoint], size: int, drain_timeout_s: float | None) -> None:
        """New endpoints for the manager, the coordinator (for ``attach``) and every listener."""
        manager = self.m
        capacity = sum(manager._startup.capacity.get(ep.rank, 0) for ep in engines)
        endpoints = msgspec.structs.replace(self._endpoints(), engines=list(engines), capacity=capacity)
        manager.endpoints = endpoints
        manager.tell_coordinator(
            manager._owned.coordinator.set_cluster.remote(endpoints, manager._status_info(manager._startup)),
            "the new endpoints",
        )
        for listener in list(manager._scale_listeners):
            try:
                listener(endpoints, size, drain_timeout_s)
            except Exception:
                logger.exception("scale listener failed")

