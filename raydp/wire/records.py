"""Control-plane records: what a cluster's coordinator keeps and reports about it.

The coordinator holds the cluster's record (:class:`ClusterInfo` with its
:class:`APIServerRecord` list, and the :class:`LaunchRecord`) for
``raydp.attach``, ``raydp status`` and ``raydp scale``, and describes its own
state as a :class:`CoordinatorStatus`. They travel as Ray actor arguments and
results, or msgpack on the ``mp`` backend's control pipe (all but
:class:`LaunchRecord`, which holds a class and only Ray carries).
"""

from __future__ import annotations

from typing import Any

import msgspec

from raydp.config import RaydpConfig
from raydp.wire.adapters import AdapterState
from raydp.wire.endpoints import ClusterEndpoints


class CoordinatorStatus(msgspec.Struct, frozen=True):
    """The coordinator's wave, running flag, per-rank counts and counters, for operators and tests."""

    wave: int
    running: bool
    dp_size: int  # ranks the coordinator knows
    routable: int  # ranks clients may route to (fewer while a scale-down drains)
    hold: str | None  # the lockstep gang's hold phase, None when none is held
    counts: list[list[int]]  # per rank: [waiting, running]
    work: list[int]  # per rank: tokens left to generate, -1 where the engine reports none (yet)
    dead: dict[int, str]  # dead rank -> cause
    deaths: list[int]  # per rank, since launch
    restarts: list[int]  # per rank, since launch
    dropped: int  # malformed or unknown-rank messages dropped
    broadcasts: int
    subscribed: list[int]  # ranks whose engines subscribed
    resynced: bool  # a restarted coordinator has heard every live rank again
    # per rank: [prompt tokens looked up in its prefix cache, tokens found]; empty when no engine reports one
    prefix_cache: list[list[int]] = []
    hangs: list[int] = []  # per rank, since launch: deaths whose cause was a hang its watchdog caught
    adapters: list[AdapterState] = []  # per rank: the LoRA adapters it holds; empty when no engine reports any
    prefill_ranks: int = -1  # P/D: the prefill pool's size as last moved (-1: as launched)
    silent_s: list[float] = []  # per rank: seconds since its last word (0.0: none yet); see coordinator.silence


class APIServerRecord(msgspec.Struct, frozen=True):
    """Where one group of API servers listens, for ``raydp status``."""

    mode: str  # internal, hybrid or external
    url: str
    count: int  # processes
    node_id: str | None = None
    ranks: list[int] | None = None  # None: every rank


class AutoscaleDecision(msgspec.Struct, frozen=True):
    """The autoscaler's latest reading: the size it found, the size it wants, and why (empty: no change)."""

    current: int
    desired: int
    reason: str
    at: float  # wall-clock time of the reading
    pool: str = ""  # P/D: the pool it sizes ("prefill" or "decode"); "" for an unpooled cluster


class ClusterInfo(msgspec.Struct, frozen=True):
    """What ``raydp status`` shows beyond the coordinator's state."""

    accelerator: str = ""
    devices: list[list[str]] = []  # per rank: its device ids
    lockstep: bool = False
    engine: str = ""
    api_servers: list[APIServerRecord] = []
    autoscale: AutoscaleDecision | None = None  # None: the cluster does not autoscale
    prefill_autoscale: AutoscaleDecision | None = None  # P/D: the prefill pool's autoscaler, if any


class LaunchRecord(msgspec.Struct, frozen=True):
    """How a cluster was launched, for another process that scales it (``raydp scale``)."""

    config: RaydpConfig
    engine_cls: Any = None  # the engine class the launcher was given, None when it named a path


class ClusterStatus(msgspec.Struct, frozen=True):
    """One running cluster as its coordinator knows it: what ``raydp status`` prints."""

    name: str
    endpoints: ClusterEndpoints | None  # None while the cluster is starting
    state: CoordinatorStatus
    info: ClusterInfo
