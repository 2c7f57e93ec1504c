"""Ranks joining a cluster on Ray: the startup handshake, a DP rendezvous, the coordinator's subscription.

The same steps bring ranks in at launch, after a restart (one dense rank, or a
lockstep gang) and on a scale-up. Every wait also watches the ranks' (and the
coordinator's) ``run()`` refs, so a rank that dies while joining fails the
join at once, naming it, instead of running into a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
import zmq

from raydp.actors.deaths import death_of
from raydp.actors.owned import Owned
from raydp.actors.watch import check_started
from raydp.config import RaydpConfig
from raydp.errors import StartupError
from raydp.orchestration.ranks import RankRecord
from raydp.orchestration.runtime import CoordinatorUnavailableError, InitFor, Progress, join_ranks
from raydp.wire.handshake import HandshakeResult, HandshakeServer
from raydp.wire.security import CurveKeys, guard
from raydp.wire.transport import IpcDir


class RankJoining:
    """The joining steps of one cluster's ranks; see the module docstring."""

    def __init__(
        self,
        config: RaydpConfig,
        owned: Owned,
        *,
        ipc_prefix: str,
        sock_opts: Any,
        curve: CurveKeys | None,
        driver_node_id: str,
    ) -> None:
        self.config = config
        self.owned = owned
        self.ipc_prefix = ipc_prefix
        self.sock_opts = sock_opts
        self.curve = curve
        self.driver_node_id = driver_node_id
        self.coordinator_ref: Any = None  # the coordinator's run() ref, watched by startup's waits
        # Once the cluster serves, a join (a restart, a scale-up) goes on whatever the coordinator
        # does: its death is reported and handled on its own, and a successor resyncs the ranks.
        self.serving = False
        self.lock = threading.Lock()

    def watched(self, records: Sequence[RankRecord]) -> dict[Any, int]:
        refs = {r.run_ref: r.rank for r in records if r.run_ref is not None}
        if self.coordinator_ref is not None and not self.serving:
            refs[self.coordinator_ref] = -1
        return refs

    def handshake(
        self, records: Sequence[RankRecord], init_for: InitFor, progress: Progress | None, watched: Sequence[RankRecord]
    ) -> HandshakeResult:
        """Run ``records`` through the handshake; sets their run refs and capacities."""
        cfg, owned = self.config, self.owned
        ctx = self._open_frontend()
        server = HandshakeServer(ctx, self.sock_opts, transport=cfg.transport, ipc_dir=owned.ipc_dir)
        refs: dict[Any, int] = {}

        def start(addresses: list[str]) -> None:
            for record in records:
                record.run_ref = record.handle.run.remote(addresses)
                owned.run_refs.append(record.run_ref)
            refs.update(self.watched([*watched, *records]))

        return join_ranks(
            server,
            records,
            start,
            lambda r: r.node_id == self.driver_node_id,
            init_for,
            cfg,
            lambda: self.check_live(refs),
            progress,
        )

    def _open_frontend(self) -> zmq.Context[zmq.Socket[bytes]]:
        owned = self.owned
        with self.lock:
            if owned.ctx is not None:
                return owned.ctx
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            owned.ctx = ctx
            owned.ipc_dir = IpcDir(f"{self.ipc_prefix}-frontend")
            gate = guard(owned.ctx, self.curve)
            if gate is not None:
                owned.closers.append(gate.stop)  # before the context is destroyed
            return ctx

    def dp_master(self, rank0: Any, size: int, watched: Sequence[RankRecord]) -> str:
        """Rank 0's new rendezvous; fails at once if one of ``watched`` (or the coordinator) ends."""
        ref = rank0.dp_master.remote(size)
        refs = self.watched(watched)
        if self.coordinator_ref is not None:  # a gang restart's new group needs the coordinator's wave
            refs[self.coordinator_ref] = -1
        deadline = time.monotonic() + self.config.component_start_s
        while not ray.wait([ref], timeout=0.05)[0]:
            check_started(refs)
            if time.monotonic() > deadline:
                raise StartupError("rank 0 did not start in time to host the DP rendezvous")
        found = death_of(ref)
        if found is not None:
            raise StartupError(f"engine rank 0 failed during startup ({found[0].value}):\n{found[1]}")
        return str(ray.get(ref))

    def check_live(self, watched: dict[Any, int]) -> None:
        """Startup (or a restart) fails at once if a watched ref finished or close() began."""
        if self.owned.stop.is_set():
            raise StartupError(f"cluster {self.config.name!r} is closing")
        check_started(watched)

    def wait_subscribed(self, coordinator: Any, count: int, rank: int | None, watched: Sequence[RankRecord]) -> bool:
        """Until ``count`` engines (or, given, engine ``rank``) subscribed to the coordinator's broadcast."""
        wait_s = self.config.handshake_timeout_s
        if rank is None:
            ref = coordinator.wait_for_engines.remote(count, wait_s)
        else:  # a restarted rank: whatever its peers do (one may be dead for good meanwhile)
            ref = coordinator.wait_for_rank.remote(rank, wait_s)
        refs = {r.run_ref: r.rank for r in watched if r.run_ref is not None}
        try:
            while not ray.wait([ref], timeout=0.05)[0]:
                self.check_live(refs)
            return bool(ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            raise CoordinatorUnavailableError(str(exc)) from exc
