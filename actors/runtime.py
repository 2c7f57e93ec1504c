"""``RayRuntime``: the orchestration :class:`~raydp.orchestration.runtime.Runtime` over Ray.

Engines are :class:`~raydp.actors.engine.EngineCoreActor` actors in their
ranks' placement groups, the coordinator a :class:`~raydp.actors.coordinator.CoordinatorActor`
pinned to rank 0's node, deaths the ends of their ``run()`` refs, watched on
one thread (:func:`~raydp.actors.watch.watch_run_refs`). Everything it
creates is recorded in the launch's :class:`~raydp.actors.owned.Owned`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from raydp.actors.coordinator import CoordinatorActor
from raydp.actors.engine import DeviceProbe, EngineCoreActor
from raydp.actors.joining import RankJoining
from raydp.actors.owned import Owned
from raydp.actors.slots import place_more, place_ranks, start_device_probes
from raydp.actors.terminate import create_successor, kill_and_wait
from raydp.actors.watch import watch_run_refs
from raydp.config import RaydpConfig
from raydp.coordinator.resync import Restored
from raydp.errors import DeathCause
from raydp.names import NAMESPACE, coordinator_name, rank_name
from raydp.orchestration.ranks import RankRecord, RankTable
from raydp.orchestration.runtime import InitFor, Progress
from raydp.placement.groups import remove_groups
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints
from raydp.wire.handshake import HandshakeResult
from raydp.wire.records import APIServerRecord, AutoscaleDecision, ClusterInfo, CoordinatorStatus, LaunchRecord
from raydp.wire.security import CurveKeys

logger = logging.getLogger("raydp.manager")
# How long a write of the cluster record to a live coordinator may take (one actor call).
HAND_TIMEOUT_S = 30.0
Report = Callable[[int, DeathCause, str], None]


class RayRuntime:
    """Ray actors and placement groups for one cluster; see the module docstring."""

    restarts_gangs = True
    restarts_coordinator = True

    def __init__(
        self,
        config: RaydpConfig,
        owned: Owned,
        table: RankTable,
        *,
        driver_node_id: str,
        ipc_prefix: str,
        sock_opts: Any,
        curve: CurveKeys | None,
        engine_cls: type | None,
        user_groups: Sequence[PlacementGroup] | None,
    ) -> None:
        self.config = config
        self.owned = owned
        self.table = table
        self.stop = owned.stop
        self.driver_node_id = driver_node_id
        self.ipc_prefix = ipc_prefix
        self.curve = curve
        self.engine_cls = engine_cls
        self.user_groups = list(user_groups) if user_groups is not None else None
        self.joining = RankJoining(
            config, owned, ipc_prefix=ipc_prefix, sock_opts=sock_opts, curve=curve, driver_node_id=driver_node_id
        )
        self.watch_queue: queue.SimpleQueue[tuple[Any, int]] = queue.SimpleQueue()
        self.retired: set[Any] = set()  # run refs of ranks raydp ended: not deaths
        self.report: Report | None = None  # set by the backend: where deaths go
        self.api_server_records: list[APIServerRecord] = []  # for a restarted coordinator
        self.launch_record = LaunchRecord(config, engine_cls)

    # ---- placement ----------------------------------------------------------------------

    def place(self, ranks: range, existing: Sequence[RankRecord], why: str) -> list[RankRecord]:
        cfg = self.config
        if why == "launch":
            records = place_ranks(cfg, self.user_groups, self.driver_node_id, self.owned)
        else:
            records = place_more(cfg, ranks, existing, self.driver_node_id, self.owned, why)
        self.owned.nodes.update(r.node_id for r in records)
        return records

    def remove_groups(self, records: Sequence[RankRecord]) -> None:
        owned = self.owned
        groups = [r.group for r in records if r.owns_group and r.group in owned.groups]
        remove_groups(groups)
        with owned.lock:
            owned.groups[:] = [g for g in owned.groups if g not in groups]

    def probe_devices(self, records: Sequence[RankRecord]) -> list[Any]:
        return list(start_device_probes(self.config, records))

    def resolve_devices(self, probes: Sequence[Any]) -> list[tuple[str, ...]]:
        return [p.resolve(self.config.component_start_s) if isinstance(p, DeviceProbe) else tuple(p) for p in probes]

    # ---- engines ------------------------------------------------------------------------

    def spawn_engines(self, records: Sequence[RankRecord], devices: Sequence[Any], successors: bool) -> None:
        """Each is handed its device ids, or a probe of them still running that it resolves itself.

        ``successors``: the ranks' names were held by actors that have just ended (a restart, a
        scale-up after a scale-down), which Ray may not have released yet.
        """
        for record, rank_devices in zip(records, devices, strict=True):
            create = functools.partial(self._create_engine, record, rank_devices)
            record.handle = create_successor(create) if successors else create()

    def _create_engine(self, record: RankRecord, devices: tuple[str, ...] | DeviceProbe) -> Any:
        cfg = self.config
        return (
            ray.remote(EngineCoreActor)
            .options(
                num_cpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(record.group, cfg.world_size_of(record.rank)),
                **self.actor_options(rank_name(cfg.name, record.rank)),
            )
            .remote(
                cfg,
                record.rank,
                record.local_rank,
                self.driver_node_id,
                devices,
                self.ipc_prefix,
                self.engine_cls,
                self.curve,
            )
        )

    def actor_options(self, name: str) -> dict[str, Any]:
        opts: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "max_concurrency": 4}
        if self.config.detached:
            opts["lifetime"] = "detached"
        return opts

    def wait_built(self, records: Sequence[RankRecord]) -> None:
        ray.get([r.handle.wait_for_init.remote() for r in records], timeout=self.config.startup_wait_s)

    def join(
        self,
        records: Sequence[RankRecord],
        init_for: InitFor,
        progress: Progress | None = None,
        watched: Sequence[RankRecord] = (),
    ) -> HandshakeResult:
        return self.joining.handshake(records, init_for, progress, watched)

    def kill(self, records: Sequence[RankRecord]) -> None:
        actors = [r.handle for r in records if r.handle is not None]
        for actor in actors:  # all at once, then wait: their names and bundles must be free
            _kill(actor)
        for actor in actors:
            kill_and_wait(actor)

    def stop_engines(self, records: Sequence[RankRecord]) -> None:
        actors = [r.handle for r in records if r.handle is not None]
        refs = [a.shutdown.remote() for a in actors]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=3.0)
        for actor in actors:
            kill_and_wait(actor)

    def watch(self, records: Sequence[RankRecord]) -> None:
        self.joining.serving = True  # the first watch ends startup
        for record in records:
            if record.run_ref is not None:
                self.watch_queue.put((record.run_ref, record.rank))
        self._start_watcher()

    def retire(self, records: Sequence[RankRecord]) -> None:
        for record in records:
            if record.run_ref is not None:
                self.retired.add(record.run_ref)
                record.run_ref = None

    def in_flight(self, ranks: Sequence[int]) -> int:
        refs = [self.table[r].handle.counters.remote() for r in ranks]
        total = 0
        for ref in refs:
            try:
                c = ray.get(ref, timeout=10)
            except Exception:  # a dead rank holds nothing any more
                continue
            total += c["added"] - c["finished"] - c["aborted"]
        return total

    def dp_master(self, size: int, watched: Sequence[RankRecord]) -> str:
        return self.joining.dp_master(self.table[0].handle, size, watched)

    # ---- the coordinator ----------------------------------------------------------------

    def start_coordinator(
        self, size: int, successor_of: tuple[CoordinatorEndpoints, Restored] | None, moved: bool = False
    ) -> CoordinatorEndpoints:
        cfg = self.config
        # Pinned to rank 0's node (it needs no CPU, so it always fits there): a soft affinity
        # let Ray's spreading put it on another node, whose loss then took the coordinator with
        # it even though rank 0 lived on. A successor goes where its addresses are, or, when
        # their node died, to the node supervising the cluster (alive while anything restarts).
        if moved:
            node = self.driver_node_id
        else:
            node = successor_of[0].node_id if successor_of is not None else self.table[0].node_id

        def create() -> Any:
            return (
                ray.remote(CoordinatorActor)
                .options(
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    **self.actor_options(coordinator_name(cfg.name)),
                )
                .remote(
                    size,
                    cfg.stats_interval_s,
                    cfg.heartbeat_interval_s,
                    cfg.transport,
                    self.joining.sock_opts,
                    cfg.name,
                    self.ipc_prefix,
                    successor_of,
                    not moved,
                )
            )

        actor = create() if successor_of is None else create_successor(create)
        self.owned.coordinator = actor
        endpoints: CoordinatorEndpoints = ray.get(actor.endpoints.remote(), timeout=cfg.component_start_s)
        ref = actor.run.remote()
        self.joining.coordinator_ref = ref
        self.owned.run_refs.append(ref)
        self.watch_queue.put((ref, -1))
        return endpoints

    def follow_coordinator(self, records: Sequence[RankRecord], endpoints: CoordinatorEndpoints) -> list[int]:
        calls = {r.rank: r.handle.follow_coordinator.remote(endpoints) for r in records if r.handle is not None}
        missed = []
        for rank, ref in calls.items():
            try:
                if not ray.get(ref, timeout=HAND_TIMEOUT_S):
                    missed.append(rank)
            except ray.exceptions.RayError:  # dead or restarting: its restart joins the new coordinator
                missed.append(rank)
        return missed

    def kill_coordinator(self) -> None:
        kill_and_wait(self.owned.coordinator)

    def coordinator_state(self) -> CoordinatorStatus:
        state: CoordinatorStatus = ray.get(self.owned.coordinator.state.remote(), timeout=30)
        return state

    def wait_subscribed(self, count: int, rank: int | None, watched: Sequence[RankRecord]) -> bool:
        return self.joining.wait_subscribed(self.owned.coordinator, count, rank, watched)

    def publish(self, endpoints: ClusterEndpoints, handed: bool) -> None:
        """What ``attach``, ``raydp status`` and ``raydp scale`` read from the coordinator.

        Waited for: the coordinator is a threaded actor, so a call made right after
        ``launch`` returns, from another handle (``raydp.attach``), could otherwise
        run first and find the cluster "still starting".
        """
        coordinator = self.owned.coordinator
        if not handed:
            self.tell_coordinator(coordinator.set_cluster.remote(endpoints, self.status_info()), "the new endpoints")
            return
        refs = [coordinator.set_cluster.remote(endpoints, self.status_info(), self.launch_record)]
        refs += [coordinator.add_api_servers.remote(record) for record in self.api_server_records]
        ray.get(refs, timeout=HAND_TIMEOUT_S)

    def record_autoscale(self, decision: AutoscaleDecision) -> None:
        self.tell_coordinator(self.owned.coordinator.set_autoscale.remote(decision), "the autoscaler's decision")

    def tell_coordinator(self, ref: Any, what: str) -> None:
        """Wait for a write to the coordinator's cluster record; a dead coordinator's successor gets
        the whole record when it is restarted."""
        try:
            ray.get(ref, timeout=HAND_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            logger.warning("the coordinator did not record %s (%r); a restarted one will", what, exc)

    def status_info(self) -> ClusterInfo:
        cfg = self.config
        return ClusterInfo(cfg.accelerator, [list(r.devices) for r in self.table], cfg.lockstep, cfg.engine)

    # ---- watching -----------------------------------------------------------------------

    def _start_watcher(self) -> None:
        owned = self.owned
        if owned.watcher is not None or self.report is None:
            return
        thread = threading.Thread(
            target=watch_run_refs,
            args=({}, owned.stop, self.report, self.watch_queue, self.retired),
            name="raydp-watcher",
            daemon=True,
        )
        owned.watcher = thread
        thread.start()


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already dead, or Ray is going down
        logger.debug("kill failed: %r", exc)
