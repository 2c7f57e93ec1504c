"""Ray metrics (``ray.util.metrics``) for a cluster, so Ray's dashboard and Prometheus show raydp.

The coordinator actor exports what it knows of every rank (load, deaths,
restarts, how long since it last spoke, the wave); each engine actor exports its requests added, finished
and aborted. A background thread reads them once per interval, so the data
path never waits on a metrics call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ray.util.metrics import Counter, Gauge

from raydp.wire.adapters import AdapterState
from raydp.wire.blocks import hit_rate
from raydp.wire.records import AutoscaleDecision, CoordinatorStatus

logger = logging.getLogger("raydp.metrics")
T = TypeVar("T")
EXPORT_INTERVAL_S = 1.0
TAGS = ("cluster", "rank")


class CoordinatorMetrics:
    """Per-rank load, deaths and restarts, and the wave, as Ray gauges tagged by cluster."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster
        self.waiting = Gauge("raydp_rank_waiting", "requests waiting on the rank", TAGS)
        self.running = Gauge("raydp_rank_running", "requests running on the rank", TAGS)
        self.work = Gauge("raydp_rank_work", "tokens the rank has left to generate (engines reporting work())", TAGS)
        self.deaths = Gauge("raydp_rank_deaths", "deaths of the rank since launch", TAGS)
        self.restarts = Gauge("raydp_rank_restarts", "restarts of the rank since launch", TAGS)
        self.hangs = Gauge("raydp_rank_hangs", "deaths of the rank since launch that were hangs", TAGS)
        self.dead = Gauge("raydp_rank_dead", "1 while the rank is dead", TAGS)
        self.silent = Gauge(
            "raydp_rank_silent_seconds",
            "seconds since the rank last spoke to the coordinator (a live rank speaks every second)",
            TAGS,
        )
        self.hit_rate = Gauge(
            "raydp_rank_prefix_cache_hit_rate",
            "prompt tokens found in the rank's prefix cache, of those looked up",
            TAGS,
        )
        self.adapters_held = Gauge("raydp_rank_adapters_held", "LoRA adapters the rank holds", TAGS)
        self.adapter_loads = Gauge("raydp_rank_adapter_loads", "LoRA adapters the rank loaded since it started", TAGS)
        self.adapter_evictions = Gauge(
            "raydp_rank_adapter_evictions", "LoRA adapters the rank evicted since it started", TAGS
        )
        self.adapter_hit_rate = Gauge(
            "raydp_rank_adapter_hit_rate",
            "requests whose LoRA adapter the rank already held, of those naming one",
            TAGS,
        )
        self.wave = Gauge("raydp_wave", "the cluster's current request wave", ("cluster",))
        # ``pool``: "" for an unpooled cluster, else the P/D pool the autoscaler sizes.
        self.desired = Gauge("raydp_autoscale_desired_ranks", "the size the autoscaler wants", ("cluster", "pool"))
        self.current = Gauge("raydp_autoscale_current_ranks", "the size the autoscaler found", ("cluster", "pool"))

    def export(self, state: CoordinatorStatus) -> None:
        for rank, (waiting, running) in enumerate(state.counts):
            tags = {"cluster": self.cluster, "rank": str(rank)}
            self.waiting.set(waiting, tags)
            self.running.set(running, tags)
            self.deaths.set(state.deaths[rank], tags)
            self.restarts.set(state.restarts[rank], tags)
            self.hangs.set(state.hangs[rank] if rank < len(state.hangs) else 0, tags)
            self.dead.set(1 if rank in state.dead else 0, tags)
            if rank < len(state.silent_s):
                self.silent.set(state.silent_s[rank], tags)
            if rank < len(state.work) and state.work[rank] >= 0:
                self.work.set(state.work[rank], tags)
            rate = hit_rate(*state.prefix_cache[rank]) if rank < len(state.prefix_cache) else None
            if rate is not None:
                self.hit_rate.set(rate, tags)
            if rank < len(state.adapters) and state.adapters[rank].slots:
                self._export_adapters(state.adapters[rank], tags)
        self.wave.set(state.wave, {"cluster": self.cluster})

    def _export_adapters(self, adapters: AdapterState, tags: dict[str, str]) -> None:
        self.adapters_held.set(len(adapters.resident), tags)
        self.adapter_loads.set(adapters.loads, tags)
        self.adapter_evictions.set(adapters.evictions, tags)
        if adapters.requests:
            self.adapter_hit_rate.set(adapters.hits / adapters.requests, tags)

    def export_autoscale(self, decision: AutoscaleDecision) -> None:
        tags = {"cluster": self.cluster, "pool": decision.pool}
        self.desired.set(decision.desired, tags)
        self.current.set(decision.current, tags)


class EngineMetrics:
    """One rank's request counters as a Ray counter, tagged by cluster, rank and outcome."""

    def __init__(self, cluster: str, rank: int) -> None:
        self.requests = Counter(
            "raydp_engine_requests", "requests by outcome: added, finished, aborted", ("cluster", "rank", "outcome")
        )
        self._tags = {"cluster": cluster, "rank": str(rank)}
        self._last: dict[str, int] = {}

    def export(self, counters: dict[str, Any]) -> None:
        for outcome, total in counters.items():
            delta = int(total) - self._last.get(outcome, 0)
            if delta > 0:  # Ray counters only go up; the loop's totals are cumulative
                self.requests.inc(delta, {**self._tags, "outcome": outcome})
            self._last[outcome] = int(total)


def export_periodically(
    read: Callable[[], T], export: Callable[[T], None], stop: threading.Event, interval_s: float = EXPORT_INTERVAL_S
) -> threading.Thread:
    """Export ``read()`` every ``interval_s`` until ``stop``; a failing export is logged, never fatal."""

    def run() -> None:
        while not stop.wait(interval_s):
            try:
                export(read())
            except Exception:
                logger.exception("exporting raydp metrics to Ray failed")

    thread = threading.Thread(target=run, name="raydp-metrics", daemon=True)
    thread.start()
    return thread
