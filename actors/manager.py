"""``ActorManager``: starts a cluster's actors, watches them, and tears them down.

It plans placement, creates one placement group per rank (or validates the
user's), starts the coordinator and the engine core actors, runs the startup
handshake, and then watches every ``run()`` ref on a background thread with
``ray.wait`` at a short timeout, so a death is reported within a fraction of a
second as a typed :class:`~raydp.errors.ComponentDeadError`.

In dense mode a dead rank is restarted in its own placement group while the
restart policy (``max_restarts``) allows (:mod:`raydp.actors.rank_restart`);
in lockstep mode the whole gang restarts (:mod:`raydp.actors.gang`); a dead
coordinator is restarted at its addresses (:mod:`raydp.actors.coordinator_restart`). Everything it creates
is recorded in an :class:`~raydp.actors.owned.Owned` that ``close()``,
garbage collection and interpreter exit all release, once.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raydp.actors.coordinator import CoordinatorActor
from raydp.actors.coordinator_restart import CoordinatorRestarts
from raydp.actors.engine import DeviceProbe, EngineCoreActor
from raydp.actors.gang import GangRestarts
from raydp.actors.joining import RankJoining
from raydp.actors.owned import Owned
from raydp.actors.rank_restart import RankRestarts
from raydp.actors.slots import RankSlot, place_ranks, start_device_probes
from raydp.actors.terminate import create_successor
from raydp.actors.watch import watch_run_refs
from raydp.backend import APIServerGroup, DeathListener, DeathReports, RestartListener, ScaleListener
from raydp.config import RaydpConfig
from raydp.coordinator.client import CoordinatorClient
from raydp.coordinator.resync import Restored
from raydp.errors import (
    ClusterClosedError,
    ComponentDeadError,
    ConfigError,
    DeathCause,
    RaydpError,
    StartupError,
)
from raydp.names import NAMESPACE, coordinator_name, rank_name
from raydp.serve.settings import ServerSettings
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.handshake import HandshakeResult
from raydp.wire.security import CurveKeys
from raydp.wire.transport import ipc_prefix, socket_options

logger = logging.getLogger("raydp.manager")
# How long a write of the cluster record to a live coordinator may take (one actor call).
_HAND_TIMEOUT_S = 30.0


@dataclass
class Startup:
    """What startup learned, kept for restarts; ``run_refs`` maps a ref to its rank (-1: coordinator)."""

    coordinator_endpoints: CoordinatorEndpoints | None = None
    run_refs: dict[Any, int] = field(default_factory=dict)
    devices: list[tuple[str, ...]] = field(default_factory=list)
    dp_master: str = ""
    dp_size: int = 0  # what a rank's INIT says: the size now (a scale change moves it)
    wave: int = 0  # the wave a rank joining a running lockstep cluster starts in
    run_ref_of: dict[int, Any] = field(default_factory=dict)  # the live run() ref of each rank
    capacity: dict[int, int] = field(default_factory=dict)


class ActorManager:
    """Owns one raydp cluster's actors and groups; see the module docstring."""

    def __init__(
        self,
        config: RaydpConfig,
        *,
        placement_groups: Sequence[PlacementGroup] | None = None,
        progress: Callable[[int, int], None] | None = None,
        engine_cls: type | None = None,
    ) -> None:
        self.config = config
        self._engine_cls = engine_cls
        self._user_groups = list(placement_groups) if placement_groups is not None else None
        self._progress = progress
        self._reports = DeathReports()
        self._startup = Startup()
        self._watch_queue: queue.SimpleQueue[tuple[Any, int]] = queue.SimpleQueue()
        self._retired_refs: set[Any] = set()  # run refs of ranks a scale-down removes: not deaths
        self._report_lock = threading.RLock()
        self._scale_lock = threading.Lock()
        self.joining = RankJoining(self)
        self._gang = GangRestarts(self, config.max_restarts)
        self._rank_restarts = RankRestarts(self, config.max_restarts)
        self._coordinator_restarts = CoordinatorRestarts(self, config.coordinator_max_restarts)
        self._api_server_records: list[dict[str, Any]] = []  # for a restarted coordinator
        self._place_lock = threading.Lock()
        self._scale_listeners: list[ScaleListener] = []
        self.ipc_prefix = ipc_prefix(config.name)
        # Made per launch and handed out only through Ray (actor arguments, endpoints).
        self._curve = CurveKeys.generate() if config.uses_curve else None
        self._sock_opts = socket_options(config, self._curve)
        self._owned = Owned(name=self.ipc_prefix)
        if not config.detached:  # a detached cluster outlives its launcher: only close() ends it
            weakref.finalize(self, self._owned.release)  # at garbage collection and at exit
        self.driver_node_id: str = ray.get_runtime_context().get_node_id()
        self.slots: tuple[RankSlot, ...] = ()
        self.endpoints: ClusterEndpoints | None = None

    # ---- public ------------------------------------------------------------------

    @property
    def engines(self) -> tuple[Any, ...]:
        """Engine actor handles by rank (read-only)."""
        return tuple(self._owned.engines)

    @property
    def coordinator(self) -> Any:
        return self._owned.coordinator

    def coordinator_state(self) -> dict[str, Any]:
        """The coordinator's wave, running flag and counts."""
        return dict(ray.get(self._owned.coordinator.state.remote(), timeout=30))

    @property
    def deaths(self) -> list[ComponentDeadError]:
        return list(self._reports.deaths)

    def register_api_servers(self, record: dict[str, Any]) -> None:
        self._api_server_records.append(dict(record))
        self.tell_coordinator(self._owned.coordinator.add_api_servers.remote(record), "the API servers")

    def tell_coordinator(self, ref: Any, what: str) -> None:
        """Wait for a write to the coordinator's cluster record (see :meth:`_hand_cluster`); a dead
        coordinator's successor gets the whole record when it is restarted."""
        try:
            ray.get(ref, timeout=_HAND_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            logger.warning("the coordinator did not record %s (%r); a restarted one will", what, exc)

    def start_api_servers(
        self, endpoints: ClusterEndpoints, node_id: str, ranks: list[int], count: int, port: int, label: str,
        settings: ServerSettings | None = None,
    ) -> APIServerGroup:
        """On the rank's node, under a small actor pinned there."""
        from raydp.actors.api_servers import RemoteAPIServers

        return RemoteAPIServers(endpoints, node_id, count, port, ranks, label, settings)

    def on_death(self, listener: DeathListener) -> None:
        self._reports.on_death(listener)

    def on_restart(self, listener: RestartListener) -> None:
        """Called with the new endpoint once a dead rank has been restarted and rejoined."""
        self._reports.on_restart(listener)

    def on_scale(self, listener: ScaleListener) -> None:
        """Called with ``(endpoints, size, drain_timeout_s)`` at each step of a scale change."""
        self._scale_listeners.append(listener)

    @property
    def dp_size(self) -> int:
        return len(self.slots)

    def scale(self, dp_size: int, drain_timeout_s: float) -> ClusterEndpoints:
        """Grow or shrink to ``dp_size`` ranks (see :mod:`raydp.actors.scaling`); one change at a time."""
        from raydp.actors.scaling import Scaler

        if not self._scale_lock.acquire(blocking=False):
            raise ConfigError(f"dp_size={dp_size}: another scale of cluster {self.config.name!r} is running")
        try:
            if self._owned.stop.is_set() or self.endpoints is None:
                raise ClusterClosedError(f"cluster {self.config.name!r} is closed")
            return Scaler(self).scale(dp_size, drain_timeout_s)
        finally:
            self._scale_lock.release()

    def start(self) -> ClusterEndpoints:
        """Create everything and wait for it; on any failure release it all and raise."""
        try:
            self.slots = place_ranks(self.config, self._user_groups, self.driver_node_id, self._owned)
            self._owned.nodes.update(s.node_id for s in self.slots)
            startup = self._startup
            startup.dp_size = self.config.dp_size
            # Nothing waits on what it does not need: the coordinator's process, the device
            # probes and the ranks' processes (and their imports) all start side by side.
            ranks = [s.rank for s in self.slots]
            probes = start_device_probes(self.config, self.slots)
            self._start_engines(dict(zip(ranks, probes, strict=True)))
            coordinator = self._create_coordinator()
            self._run_coordinator(startup, coordinator)
            startup.dp_master = self.joining.dp_master(startup)
            result, refs = self.joining.handshake(startup, ranks, startup.run_refs, self._progress)
            startup.run_refs.update(refs)
            startup.devices = [probe.resolve(self.config.startup_timeout_s) for probe in probes]
            self.joining.wait_coordinator(startup.run_refs, self.config.dp_size)
            self.endpoints = self._cluster_endpoints(startup, result)
            self._hand_cluster(self._owned.coordinator)
        except RaydpError:
            self.close()
            raise
        except Exception as exc:  # a raw Ray error (e.g. a get timeout) becomes a typed one
            self.close()
            raise StartupError(f"cluster {self.config.name!r} failed to start: {exc!r}") from exc
        except BaseException:
            self.close()
            raise
        self._reports.coordinator = CoordinatorClient(
            self.endpoints.coordinator, self.driver_node_id, self._sock_opts
        )
        self._owned.closers.append(self._reports.coordinator.close)
        self._rank_restarts.budget.grant(s.rank for s in self.slots)
        self._start_watcher(startup)
        return self.endpoints

    def close(self) -> None:
        """Stop watching, shut the actors down, remove created groups. Idempotent."""
        self._owned.release()

    def leave(self) -> None:
        """Drop this process's own sockets and leave the (detached) cluster running (see ``adopt``)."""
        owned = self._owned
        with owned.lock:
            if owned.released:
                return
            owned.released = True
        owned.stop.set()
        for close in owned.closers:
            close()
        if owned.ctx is not None:
            owned.ctx.destroy(linger=0)
        if owned.ipc_dir is not None:
            owned.ipc_dir.remove()

    # ---- actors ---------------------------------------------------------------------

    def _actor_options(self, name: str) -> dict[str, Any]:
        opts: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "max_concurrency": 4}
        if self.config.detached:
            opts["lifetime"] = "detached"
        return opts

    def _create_coordinator(self, successor_of: tuple[CoordinatorEndpoints, Restored] | None = None) -> Any:
        """The coordinator actor (a restart passes its predecessor's addresses and state)."""
        cfg = self.config
        node = successor_of[0].node_id if successor_of is not None else self.slots[0].node_id
        def create() -> Any:
            return (
                ray.remote(CoordinatorActor)
                .options(
                    num_cpus=0,
                    # Pinned to rank 0's node (it needs no CPU, so it always fits there): a soft
                    # affinity let Ray's spreading put it on another node, whose loss then took
                    # the coordinator with it even though rank 0 lived on. A successor goes
                    # where its addresses are.
                    scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node, soft=False),
                    **self._actor_options(coordinator_name(cfg.name)),
                )
                .remote(len(self.slots), cfg.stats_interval_s, cfg.heartbeat_interval_s, cfg.transport,
                        self._sock_opts, cfg.name, self.ipc_prefix, successor_of)
            )

        actor = create() if successor_of is None else create_successor(create)
        self._owned.coordinator = actor
        return actor

    def _run_coordinator(self, startup: Startup, actor: Any) -> None:
        startup.coordinator_endpoints = ray.get(actor.endpoints.remote(), timeout=self.config.startup_timeout_s)
        ref = actor.run.remote()
        startup.run_refs[ref] = -1
        self._owned.run_refs.append(ref)

    def _start_engines(self, devices: Mapping[int, tuple[str, ...] | DeviceProbe], successors: bool = False) -> None:
        """Create the engine actors of the ranks in ``devices`` (all at startup, one on a restart).

        Each is handed its device ids, or a probe of them still running that it resolves itself.
        ``successors``: the ranks' names were held by actors that have just ended (a restart, a
        scale-up after a scale-down), which Ray may not have released yet.
        """
        engines = self._owned.engines
        for rank, rank_devices in devices.items():
            create = functools.partial(self._create_engine, rank, rank_devices)
            actor = create_successor(create) if successors else create()
            if rank < len(engines):
                engines[rank] = actor
            else:
                engines.append(actor)

    def _create_engine(self, rank: int, devices: tuple[str, ...] | DeviceProbe) -> Any:
        cfg, slot = self.config, self.slots[rank]
        return ray.remote(EngineCoreActor).options(
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(slot.group, cfg.world_size),
            **self._actor_options(rank_name(cfg.name, rank)),
        ).remote(
            cfg, rank, slot.local_rank, self.driver_node_id, devices, self.ipc_prefix, self._engine_cls, self._curve,
        )

    def _cluster_endpoints(self, startup: Startup, result: HandshakeResult) -> ClusterEndpoints:
        assert startup.coordinator_endpoints is not None
        engines = [
            EngineEndpoint(s.rank, s.node_id, result.ready[s.rank].input_addresses) for s in self.slots
        ]
        return ClusterEndpoints(
            self.config.name, engines, startup.coordinator_endpoints, self.config.lockstep, result.capacity,
            self.ipc_prefix, self.config.heartbeat_interval_s, self._curve,
        )

    def _hand_cluster(self, coordinator: Any) -> None:
        """What ``attach``, ``raydp status`` and ``raydp scale`` read from the coordinator.

        Waited for: the coordinator is a threaded actor, so a call made right after
        ``launch`` returns, from another handle (``raydp.attach``), could otherwise
        run first and find the cluster "still starting".
        """
        refs = [coordinator.set_cluster.remote(
            self.endpoints, self._status_info(self._startup), {"config": self.config, "engine_cls": self._engine_cls}
        )]
        refs += [coordinator.add_api_servers.remote(record) for record in self._api_server_records]
        ray.get(refs, timeout=_HAND_TIMEOUT_S)

    def _status_info(self, startup: Startup) -> dict[str, Any]:
        cfg = self.config
        return {
            "accelerator": cfg.accelerator,
            "devices": [list(d) for d in startup.devices],
            "lockstep": cfg.lockstep,
            "engine": cfg.engine,
        }

    # ---- watching -------------------------------------------------------------------

    def _start_watcher(self, startup: Startup) -> None:
        refs = dict(startup.run_refs)
        # A weak reference, so the running watcher does not keep the manager
        # alive: dropping the last handle must still close the cluster.
        report = weakref.WeakMethod(self._report)

        def report_if_alive(rank: int, cause: DeathCause, detail: str) -> None:
            method = report()
            if method is not None:
                method(rank, cause, detail)

        thread = threading.Thread(
            target=watch_run_refs,
            args=(refs, self._owned.stop, report_if_alive, self._watch_queue, self._retired_refs),
            name="raydp-watcher",
            daemon=True,
        )
        self._owned.watcher = thread
        thread.start()

    def _report(self, rank: int, cause: DeathCause, detail: str) -> None:
        with self._report_lock:  # the watcher and restart threads both report
            self._report_locked(rank, cause, detail)

    def _report_locked(self, rank: int, cause: DeathCause, detail: str) -> None:
        if rank < 0:
            self._coordinator_restarts.on_death(cause, detail)
            return
        if self.config.lockstep:
            self._gang.on_death(rank, cause, detail)
            return
        self._rank_restarts.on_death(rank, cause, detail)

    def _publish_restart(self, rank: int, result: HandshakeResult, refs: dict[Any, int]) -> None:
        endpoint = EngineEndpoint(rank, self.slots[rank].node_id, result.ready[rank].input_addresses)
        assert self.endpoints is not None
        self.endpoints = self.endpoints.with_engine(endpoint)
        self.tell_coordinator(self._owned.coordinator.set_cluster.remote(self.endpoints), f"rank {rank}'s restart")
        for ref in refs:
            self._watch_queue.put((ref, rank))
        self._reports.revived(endpoint)
