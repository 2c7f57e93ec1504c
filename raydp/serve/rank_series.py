"""raydp's per-rank series, described once and exported two ways.

:data:`RANK_GAUGES` says what each per-rank gauge is and where its value
comes from (the client's latest coordinator snapshot, or what the client
knows of the ranks' caches). Two exporters read it:

* :class:`SnapshotCollector`, a collector read at scrape time, for raydp's own
  server (one registry per process);
* :class:`PushedRankSeries`, ordinary gauges and counters that an API server
  running vLLM's front-end updates every ``interval_s``. They live in the
  process's default registry, which vLLM's ``/metrics`` serves, and work in
  prometheus_client's multiprocess mode: N processes behind one port then
  answer one aggregate (gauges: the most recent value; counters: summed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from raydp.client.client import Client
from raydp.errors import DeathCause
from raydp.wire.adapters import AdapterState
from raydp.wire.blocks import hit_rate

PUSH_INTERVAL_S = 0.5


@dataclass(frozen=True)
class RankGauge:
    """One per-rank gauge: its name, its help, its ``(rank, value)`` pairs from a client, and how N API
    server processes' values make one in prometheus_client's multiprocess mode."""

    name: str
    help: str
    values: Callable[[Client], Iterable[tuple[int, float]]]
    # Default: the same snapshot in every process, so any one of them says it.
    multiprocess_mode: Literal["mostrecent", "livesum"] = "mostrecent"


def _counts(client: Client, index: int) -> Iterable[tuple[int, float]]:
    snap = client.snapshot()
    return [] if snap is None else [(rank, pair[index]) for rank, pair in enumerate(snap.counts)]


def _dead(client: Client) -> Iterable[tuple[int, float]]:
    snap = client.snapshot()
    return [] if snap is None else [(rank, float(rank in snap.dead)) for rank in range(len(snap.counts))]


def _work(client: Client) -> Iterable[tuple[int, float]]:
    snap = client.snapshot()  # -1: the engine does not report work
    return [] if snap is None else [(rank, tokens) for rank, tokens in enumerate(snap.work) if tokens >= 0]


def _held(a: AdapterState) -> float:
    return len(a.resident)


def _loads(a: AdapterState) -> float:
    return a.loads


def _evictions(a: AdapterState) -> float:
    return a.evictions


def _adapter_hits(a: AdapterState) -> float | None:
    return a.hits / a.requests if a.requests else None


def _hits(client: Client) -> Iterable[tuple[int, float]]:
    snap = client.snapshot()
    pairs = [] if snap is None else [(rank, hit_rate(q, f)) for rank, (q, f) in enumerate(snap.hits)]
    return [(rank, rate) for rank, rate in pairs if rate is not None]


def _adapters(client: Client, read: Callable[[AdapterState], float | None]) -> Iterable[tuple[int, float]]:
    snap = client.snapshot()
    pairs = [] if snap is None else [(rank, read(a)) for rank, a in enumerate(snap.adapters) if a.slots]
    return [(rank, value) for rank, value in pairs if value is not None]


RANK_GAUGES = (
    RankGauge("raydp_rank_waiting", "waiting requests per rank", lambda c: _counts(c, 0)),
    RankGauge("raydp_rank_running", "running requests per rank", lambda c: _counts(c, 1)),
    RankGauge("raydp_rank_work", "tokens left to generate per rank", _work),
    RankGauge("raydp_rank_dead", "1 while the rank is reported dead", _dead),
    RankGauge(
        "raydp_rank_prefix_cache_hit_rate",
        "prompt tokens found in the rank's prefix cache, of those looked up (engines that report a cache)",
        _hits,
    ),
    RankGauge("raydp_rank_adapters_held", "LoRA adapters the rank holds", lambda c: _adapters(c, _held)),
    RankGauge(
        "raydp_rank_adapter_loads", "LoRA adapters the rank loaded since it started", lambda c: _adapters(c, _loads)
    ),
    RankGauge(
        "raydp_rank_adapter_evictions",
        "LoRA adapters the rank evicted since it started",
        lambda c: _adapters(c, _evictions),
    ),
    RankGauge(
        "raydp_rank_adapter_hit_rate",
        "requests whose LoRA adapter the rank already held, of those naming one",
        lambda c: _adapters(c, _adapter_hits),
    ),
    RankGauge(
        "raydp_router_in_flight",
        "requests this API server sent to each rank that have not finished, from its own books (raydp_rank_running "
        "follows the coordinator's snapshots); vLLM's /metrics sums it over the API servers",
        lambda c: list(enumerate(c.in_flight())),
        multiprocess_mode="livesum",
    ),
    RankGauge(
        "raydp_router_cached_blocks",
        "prefix-cache blocks this API server knows each rank holds (what the prefix balancer routes on)",
        lambda c: list(enumerate(c.cached_blocks())),
    ),
)
MIGRATIONS = (
    "raydp_stream_migrations",
    "streams moved to a live rank after theirs died mid-stream (--migration-limit)",
)
DEATHS = ("raydp_rank_deaths", "live-to-dead changes of a rank seen by this server")
HANGS = ("raydp_rank_hangs", "deaths seen by this server whose cause was a hang (no progress for step_timeout_s)")


class DeathWatch:
    """The ranks that went from live to dead since the last look, with their causes."""

    def __init__(self) -> None:
        self._dead: set[int] = set()

    def new_deaths(self, client: Client) -> list[tuple[int, str]]:
        snap = client.snapshot()
        if snap is None:
            return []
        dead = set(snap.dead)
        new = [(rank, snap.dead[rank]) for rank in sorted(dead - self._dead)]
        self._dead = dead
        return new


def count_deaths(new: list[tuple[int, str]], deaths: Counter, hangs: Counter) -> None:
    for rank, cause in new:
        deaths.labels(str(rank)).inc()
        if cause == DeathCause.HUNG.value:
            hangs.labels(str(rank)).inc()


class SnapshotCollector:
    """:data:`RANK_GAUGES`, migrations and which server answered, read from ``client`` at scrape time."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def collect(self) -> Iterable[Metric]:
        client = self.client
        info = GaugeMetricFamily(
            "raydp_api_server_info", "the API server process that answered", labels=["client_index", "client_count"]
        )
        info.add_metric([str(client.client_index), str(client.client_count)], 1)
        families: list[Metric] = [info]
        for gauge in RANK_GAUGES:
            family = GaugeMetricFamily(gauge.name, gauge.help, labels=["rank"])
            for rank, value in gauge.values(client):
                family.add_metric([str(rank)], value)
            families.append(family)
        moved = CounterMetricFamily(*MIGRATIONS)
        moved.add_metric([], client.migrations)
        return [*families, moved]


class PushedRankSeries:
    """:data:`RANK_GAUGES` as gauges, and migrations and deaths as counters, in the default registry.

    Built before the first scrape; :meth:`run` updates them until cancelled.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self._gauges = [
            (g, Gauge(g.name, g.help, ["rank"], multiprocess_mode=g.multiprocess_mode)) for g in RANK_GAUGES
        ]
        self._migrations = Counter(*MIGRATIONS)
        self._deaths = Counter(*DEATHS, ["rank"])
        self._hangs = Counter(*HANGS, ["rank"])
        self._moved = 0
        self._watch = DeathWatch()

    def update(self) -> None:
        for gauge, metric in self._gauges:
            for rank, value in gauge.values(self.client):
                metric.labels(str(rank)).set(value)
        moved = self.client.migrations
        if moved > self._moved:
            self._migrations.inc(moved - self._moved)
            self._moved = moved
        count_deaths(self._watch.new_deaths(self.client), self._deaths, self._hangs)

    async def run(self, interval_s: float = PUSH_INTERVAL_S) -> None:
        while True:
            self.update()
            await asyncio.sleep(interval_s)
