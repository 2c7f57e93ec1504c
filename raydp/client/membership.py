"""Which ranks a client knows, from the coordinator's snapshots: pure logic, no sockets.

A client outside the launching process (an API server, an attached notebook)
learns of a scale change only from the coordinator. A snapshot lists how many
ranks exist (``len(counts)``), how many take new requests (``size``), and the
node and addresses of every rank added or moved since launch. Ranks are dense,
so a client adopts the longest prefix of ranks it has addresses for: a rank
whose addresses have not arrived yet (it is still joining) waits, and so do
the ranks after it. Deaths and restarts come in the same snapshots
(:func:`liveness`), in order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from raydp.errors import DeathCause, EngineDeadError
from raydp.wire.control import StatsSnapshot
from raydp.wire.endpoints import EngineEndpoint


def membership(known: Sequence[EngineEndpoint], snap: StatsSnapshot) -> tuple[list[EngineEndpoint], int]:
    """The ranks to hold after ``snap`` (``known`` are the ones held now), and how many to route to."""
    exists = len(snap.counts)
    engines: list[EngineEndpoint] = []
    for rank in range(exists):
        if rank < len(known):
            engines.append(known[rank])  # a rank that moved (restarted) is followed by the liveness notices
        elif rank in snap.moved:
            engines.append(EngineEndpoint(rank, snap.nodes.get(rank, ""), list(snap.moved[rank])))
        else:
            break  # not joined yet
    size = snap.size if snap.size > 0 else exists
    return engines, max(1, min(size, len(engines)))


def liveness(
    known: Sequence[EngineEndpoint], dead: Collection[int], snap: StatsSnapshot
) -> tuple[list[EngineDeadError], list[EngineEndpoint]]:
    """What ``snap`` says a client holding ``known`` (``dead`` among them) has yet to hear: deaths, and the
    endpoints of ranks that came back or moved (a rank re-added may sit on another node)."""
    deaths: list[EngineDeadError] = []
    revived: list[EngineEndpoint] = []
    for ep in known:
        if ep.rank in snap.dead:
            if ep.rank not in dead:
                deaths.append(
                    EngineDeadError(ep.rank, ep.node_id, _cause(snap.dead[ep.rank]), "reported by the coordinator")
                )
        elif ep.rank in dead or ep.rank in snap.moved:
            addresses = snap.moved.get(ep.rank, ep.input_addresses)
            revived.append(EngineEndpoint(ep.rank, snap.nodes.get(ep.rank, ep.node_id), addresses))
    return deaths, revived


def _cause(text: str) -> DeathCause:
    try:
        return DeathCause(text)
    except ValueError:
        return DeathCause.UNKNOWN
