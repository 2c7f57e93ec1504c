"""What the coordinator's state tells others: the snapshot clients get, the status operators get.

Pure record-building over :class:`~raydp.coordinator.state.CoordinatorState`;
when to publish stays with the state. What is read of the state is
:class:`Published`, so that the state can call this module without this
module importing it back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import msgspec

from raydp.coordinator.cache import CachePictures
from raydp.coordinator.resync import ResyncTracker
from raydp.wire.adapters import AdapterState
from raydp.wire.control import StatsSnapshot
from raydp.wire.records import CoordinatorStatus


class Published(Protocol):
    """What the snapshot and the status read of the coordinator's state (see its fields for their meaning)."""

    engine_count: int
    wave: int
    running: bool
    counts: list[list[int]]
    work: list[int]
    dead: dict[int, str]
    moved: dict[int, list[str]]
    deaths: list[int]
    restarts: list[int]
    hangs: list[int]
    rejected: int
    size: int
    prefill_ranks: int
    nodes: dict[int, str]
    resync: ResyncTracker | None
    cache: CachePictures
    adapters: list[AdapterState]

    def hold_phase(self) -> str | None: ...


def snapshot(state: Published, seq: int, now: float) -> StatsSnapshot:
    """The snapshot numbered ``seq``; takes the cache changes pending at ``now`` (they are published once)."""
    cache = state.cache
    return StatsSnapshot(
        counts=[(w, r) for w, r in state.counts],
        wave=state.wave,
        running=state.running,
        seq=seq,
        dead=dict(state.dead),
        moved={r: list(a) for r, a in state.moved.items()},
        size=state.size,
        nodes=dict(state.nodes),
        work=list(state.work) if any(w >= 0 for w in state.work) else [],
        cache=cache.changes(now),
        hits=cache.hit_counts(),
        cache_versions=cache.versions(),
        cache_epoch=cache.epoch if cache.reported else 0,
        adapters=[msgspec.structs.replace(a, known={}) for a in state.adapters] if _adapters_reported(state) else [],
        adapter_paths={name: path for a in state.adapters for name, path in a.known.items()},
        prefill_ranks=state.prefill_ranks,
    )


def describe(
    state: Published, *, dropped: int = 0, broadcasts: int = 0, subscribed: Iterable[int] = ()
) -> CoordinatorStatus:
    """The state as the coordinator describes it; the loop adds its socket counters and subscribers."""
    return CoordinatorStatus(
        wave=state.wave,
        running=state.running,
        dp_size=state.engine_count,
        routable=state.size,
        hold=state.hold_phase(),
        counts=[list(c) for c in state.counts],
        work=list(state.work),
        dead=dict(state.dead),
        deaths=list(state.deaths),
        restarts=list(state.restarts),
        hangs=list(state.hangs),
        dropped=dropped + state.rejected,
        broadcasts=broadcasts,
        subscribed=sorted(subscribed),
        resynced=state.resync is None or state.resync.done,  # a successor heard every live rank
        prefix_cache=[list(h) for h in state.cache.hit_counts()],
        adapters=list(state.adapters) if _adapters_reported(state) else [],
        prefill_ranks=state.prefill_ranks,
    )


def _adapters_reported(state: Published) -> bool:
    """Whether any rank holds (or can hold) a LoRA adapter: snapshots and the status carry them only then."""
    return any(a.slots or a.resident for a in state.adapters)
