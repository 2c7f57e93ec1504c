"""Where a running cluster's sockets are: handed to clients through Ray, never over ZMQ."""

from __future__ import annotations

import msgspec

from raydp.wire.security import CurveKeys


class EngineEndpoint(msgspec.Struct, frozen=True):
    rank: int
    node_id: str
    input_addresses: list[str]


class CoordinatorEndpoints(msgspec.Struct, frozen=True):
    node_id: str
    publish: list[str]
    collect: list[str]
    broadcast: list[str]


class ClusterEndpoints(msgspec.Struct, frozen=True):
    """Everything a client needs to talk to a cluster."""

    name: str
    engines: list[EngineEndpoint]
    coordinator: CoordinatorEndpoints
    lockstep: bool
    capacity: int = 0
    ipc_prefix: str = ""  # names this launch's IPC directories (cluster name + a random tag)
    heartbeat_interval_s: float = 1.0  # the coordinator publishes at least this often
    curve: CurveKeys | None = None  # set when TCP peers must authenticate (config.auth)
    prefill_ranks: int = 0  # P/D: ranks 0..prefill_ranks-1 prefill, the others decode (0: every rank does both)

    def pool(self, rank: int) -> str:
        """The pool ``rank`` serves in: "prefill", "decode", or "" where the ranks are not pooled."""
        if not self.prefill_ranks:
            return ""
        return "prefill" if rank < self.prefill_ranks else "decode"

    def with_engine(self, endpoint: EngineEndpoint) -> ClusterEndpoints:
        """These endpoints with one rank moved (a restarted rank binds new addresses)."""
        engines = [endpoint if e.rank == endpoint.rank else e for e in self.engines]
        return msgspec.structs.replace(self, engines=engines)

    def with_engines(self, engines: list[EngineEndpoint], capacity: int) -> ClusterEndpoints:
        """These endpoints with another set of ranks (a scale change) and their capacity."""
        return msgspec.structs.replace(self, engines=list(engines), capacity=capacity)
