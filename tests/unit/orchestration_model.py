"""The orchestration sequences over an in-memory runtime: what the property tests drive.

:class:`ModelRuntime` implements :class:`raydp.orchestration.runtime.Runtime`
with no processes: ranks are records, a join hands out fresh addresses, and
the coordinator is the test's :class:`~raydp.coordinator.state.CoordinatorState`.
:class:`ModelCoordinator` stands in for the coordinator's PUSH client: each
control message is encoded and given to the test's ``deliver``, which applies
it at once or queues it on a modelled channel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from raydp.config import RaydpConfig
from raydp.coordinator.state import CoordinatorState
from raydp.errors import StartupError
from raydp.orchestration.core import Orchestrator
from raydp.orchestration.owned import OwnedResources
from raydp.orchestration.ranks import RankRecord
from raydp.wire.codec import encode
from raydp.wire.control import (
    EngineDead,
    EngineRevived,
    HoldCluster,
    RegroupCluster,
    ReleaseCluster,
    ScaleEngines,
)
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.handshake import HandshakeResult
from raydp.wire.protocol import Ready
from raydp.wire.records import CoordinatorStatus

COORDINATOR = CoordinatorEndpoints("node0", ["ipc:///model/pub"], ["ipc:///model/collect"], ["ipc:///model/bcast"])


def address(rank: int, generation: int) -> list[str]:
    return [f"tcp://10.0.0.{rank}:{7000 + generation}"]


class ModelCoordinator:
    """The coordinator's control client, over the test's channel."""

    def __init__(self, deliver: Callable[[bytes], None]) -> None:
        self.deliver = deliver

    def engine_dead(self, rank: int, cause: str) -> None:
        self.deliver(encode(EngineDead(rank, cause)))

    def engine_revived(self, rank: int, input_addresses: list[str], node_id: str = "") -> None:
        self.deliver(encode(EngineRevived(rank, input_addresses, node_id)))

    def scale(self, engine_count: int, size: int, prefill: int = -1) -> None:
        self.deliver(encode(ScaleEngines(engine_count, size, prefill)))

    def hold(self, epoch: int, gang: int) -> None:
        self.deliver(encode(HoldCluster(epoch, gang)))

    def regroup(self, epoch: int, dp_size: int, dp_master: str) -> None:
        self.deliver(encode(RegroupCluster(epoch, dp_size, dp_master)))

    def release(self, epoch: int) -> None:
        self.deliver(encode(ReleaseCluster(epoch)))

    def close(self) -> None:
        pass


class ModelRuntime:
    """Ranks as records, the coordinator as the test's state; see the module docstring."""

    restarts_gangs = True
    restarts_coordinator = False

    def __init__(self, coordinator: Callable[[], CoordinatorState]) -> None:
        self.stop = threading.Event()
        self.coordinator = coordinator
        self.generation = 0
        self.alive: set[int] = set()  # ranks whose engines run
        self.watched: set[int] = set()
        self.masters = 0
        self.decisions: list[Any] = []
        self.published: list[ClusterEndpoints] = []  # what clients were told, in order
        self.wedged_starts = 0  # the next so many joins fail, as a successor that wedged while starting

    def place(self, ranks: range, existing: Sequence[RankRecord], why: str) -> list[RankRecord]:
        return [RankRecord(rank, f"node{rank}") for rank in ranks]

    def remove_groups(self, records: Sequence[RankRecord]) -> None:
        pass

    def probe_devices(self, records: Sequence[RankRecord]) -> list[Any]:
        return [() for _ in records]

    def resolve_devices(self, probes: Sequence[Any]) -> list[tuple[str, ...]]:
        return [() for _ in probes]

    def spawn_engines(self, records: Sequence[RankRecord], devices: Sequence[Any], successors: bool) -> None:
        for record in records:
            record.handle = f"engine-{record.rank}"
            self.alive.add(record.rank)

    def wait_built(self, records: Sequence[RankRecord]) -> None:
        pass

    def join(
        self, records: Sequence[RankRecord], init_for: Any, progress: Any = None, watched: Sequence[RankRecord] = ()
    ) -> HandshakeResult:
        if self.wedged_starts > 0:
            self.wedged_starts -= 1
            raise StartupError(f"engine rank {records[0].rank} did not start within startup_timeout_s=3")
        result = HandshakeResult()
        for record in records:
            self.generation += 1
            init_for(record.rank)  # what the rank would be told: must be answerable
            result.ready[record.rank] = Ready(256, "hash", address(record.rank, self.generation))
            record.capacity = 256
            record.run_ref = (record.rank, self.generation)
        return result

    def kill(self, records: Sequence[RankRecord]) -> None:
        self.alive -= {r.rank for r in records}

    def stop_engines(self, records: Sequence[RankRecord]) -> None:
        self.kill(records)

    def watch(self, records: Sequence[RankRecord]) -> None:
        self.watched |= {r.rank for r in records}

    def retire(self, records: Sequence[RankRecord]) -> None:
        self.watched -= {r.rank for r in records}
        for record in records:
            record.run_ref = None

    def in_flight(self, ranks: Sequence[int]) -> int:
        return 0

    def dp_master(self, size: int, watched: Sequence[RankRecord]) -> str:
        self.masters += 1
        return f"m{self.masters}"

    def start_coordinator(self, size: int, successor_of: Any, moved: bool = False) -> CoordinatorEndpoints:
        return COORDINATOR

    def follow_coordinator(self, records: Sequence[RankRecord], endpoints: CoordinatorEndpoints) -> list[int]:
        return []

    def kill_coordinator(self) -> None:
        pass

    def coordinator_state(self) -> CoordinatorStatus:
        return status_of(self.coordinator())

    def wait_subscribed(self, count: int, rank: int | None, watched: Sequence[RankRecord]) -> bool:
        return True

    def record_autoscale(self, decision: Any) -> None:
        self.decisions.append(decision)

    def publish(self, endpoints: ClusterEndpoints, handed: bool) -> None:
        self.published.append(endpoints)


def status_of(s: CoordinatorState) -> CoordinatorStatus:
    """What the coordinator's ``describe`` says of state ``s`` (no sockets: no counters, no subscribers)."""
    return s.status()


def started(
    n: int, runtime: ModelRuntime, coordinator: ModelCoordinator, *, lockstep: bool = False, **fields: Any
) -> Orchestrator:
    """An orchestrator that has started ``n`` ranks over ``runtime`` (:meth:`Orchestrator.start` itself);
    ``fields`` are more of its :class:`RaydpConfig`. No step timeout: a model rank cannot hang or freeze, and
    the silence watch's thread would outlive the test (the tests drive :class:`SilenceWatch` themselves)."""
    base = {"name": "model", "dp_size": n, "lockstep": lockstep, "stats_interval_s": 0.125, "handshake_timeout_s": 5}
    config = RaydpConfig(**base | {"step_timeout_s": None} | fields)
    o = Orchestrator(
        config,
        runtime,
        OwnedResources(),
        driver_node_id="node0",
        ipc_prefix="model",
        sock_opts=None,
        control=lambda endpoints: coordinator,
    )
    o.start()
    return o


def engines_of(o: Orchestrator) -> list[EngineEndpoint]:
    assert o.endpoints is not None
    return list(o.endpoints.engines)
