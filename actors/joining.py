"""Ranks joining a cluster: the startup handshake, rank 0's DP rendezvous, the coordinator's subscription.

The same steps bring ranks in at launch, after a restart (one dense rank, or a
lockstep gang) and on a scale-up; :class:`RankJoining` runs them for its
:class:`~raydp.actors.manager.ActorManager`. Every wait also watches the
ranks' ``run()`` refs, so a rank that dies while joining fails the join at
once, naming it, instead of running into a timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
import zmq

from raydp.actors.deaths import death_of
from raydp.actors.watch import check_started
from raydp.errors import StartupError
from raydp.wire.handshake import HandshakeResult, HandshakeServer, parallel_config
from raydp.wire.protocol import EngineAddresses, Init
from raydp.wire.security import guard
from raydp.wire.transport import IpcDir, pick_address

if TYPE_CHECKING:
    from raydp.actors.manager import ActorManager, Startup


class RankJoining:
    """The joining steps of one manager's ranks; see the module docstring."""

    def __init__(self, manager: ActorManager) -> None:
        self.m = manager

    def handshake(
        self,
        startup: Startup,
        ranks: list[int],
        also_watch: dict[Any, int],
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[HandshakeResult, dict[Any, int]]:
        """Run ``ranks`` through the handshake; return the result and their run refs."""
        cfg = self.m.config
        owned = self.m._owned
        if owned.ctx is None:
            owned.ctx = zmq.Context()
            owned.ipc_dir = IpcDir(f"{self.m.ipc_prefix}-frontend")
            gate = guard(owned.ctx, self.m._curve)
            if gate is not None:
                owned.closers.append(gate.stop)  # before the context is destroyed
        server = HandshakeServer(
            owned.ctx, self.m._sock_opts, transport=cfg.transport, ipc_dir=owned.ipc_dir
        )
        watched = dict(also_watch)
        refs = {}
        for rank in ranks:
            ref = owned.engines[rank].run.remote(server.addresses)
            refs[ref] = rank
            owned.run_refs.append(ref)
        watched.update(refs)
        for ref, rank in refs.items():
            startup.run_ref_of[rank] = ref
        try:
            result = server.run(
                {r: self.m.slots[r].node_id == self.m.driver_node_id for r in ranks},
                lambda rank: self._init_for(rank, startup, startup.dp_master),
                cfg.config_hash(),
                cfg.startup_timeout_s,
                liveness=lambda: self.check_live(watched),
                progress=progress,
            )
        finally:
            server.close()
        startup.capacity.update({rank: ready.capacity for rank, ready in result.ready.items()})
        return result, refs

    def dp_master(self, startup: Startup, watched: dict[Any, int] | None = None) -> str:
        """Rank 0's new rendezvous; fails at once if one of ``watched`` (default: startup's refs) ends."""
        if not self.m.config.lockstep:
            return ""
        ref = self.m._owned.engines[0].dp_master.remote(startup.dp_size or None)
        deadline = time.monotonic() + self.m.config.startup_timeout_s
        while not ray.wait([ref], timeout=0.05)[0]:
            check_started(startup.run_refs if watched is None else watched)
            if time.monotonic() > deadline:
                raise StartupError("rank 0 did not start in time to host the DP rendezvous")
        found = death_of(ref)
        if found is not None:
            raise StartupError(f"engine rank 0 failed during startup ({found[0].value}):\n{found[1]}")
        return str(ray.get(ref))

    def _init_for(self, rank: int, startup: Startup, dp_master: str) -> Init:
        cfg = self.m.config
        coord = startup.coordinator_endpoints
        assert coord is not None
        same = self.m.slots[rank].node_id == coord.node_id
        return Init(
            EngineAddresses(pick_address(coord.collect, same_node=same), pick_address(coord.broadcast, same_node=same)),
            parallel_config(cfg, dp_master, startup.dp_size, startup.wave),
        )

    def check_live(self, watched: dict[Any, int]) -> None:
        """Startup (or a restart) fails at once if a watched ref finished or close() began."""
        if self.m._owned.stop.is_set():
            raise StartupError(f"cluster {self.m.config.name!r} is closing")
        check_started(watched)

    def wait_coordinator(self, watched: dict[Any, int], dp_size: int, rank: int | None = None) -> None:
        """Block until ``dp_size`` engines (or, given, engine ``rank``) subscribed to the coordinator's broadcast."""
        coordinator, wait_s = self.m._owned.coordinator, self.m.config.handshake_timeout_s
        if rank is None:
            ref = coordinator.wait_for_engines.remote(dp_size, wait_s)
        else:  # a restarted rank: whatever its peers do (one may be dead for good meanwhile)
            ref = coordinator.wait_for_rank.remote(rank, wait_s)
        while not ray.wait([ref], timeout=0.05)[0]:
            self.check_live(watched)
        if not ray.get(ref):
            raise StartupError("engines did not subscribe to the coordinator's broadcast in time")
