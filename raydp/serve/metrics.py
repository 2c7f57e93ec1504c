"""Prometheus metrics of one API server process, in a registry of its own.

``GET /metrics`` serves (Prometheus text, or OpenMetrics if the scraper asks):

* ``raydp_http_requests_total{route,status}``: answers by route (``other``
  for paths that are no route, so junk paths add no series) and status; a
  client that hung up before its answer counts as status 499;
* ``raydp_http_request_duration_seconds{route}``: arrival to last byte out;
* ``raydp_time_to_first_token_seconds``: arrival at the handler to the first token;
* ``raydp_generated_tokens_total``: tokens sent to clients;
* ``raydp_rank_waiting{rank}`` / ``raydp_rank_running{rank}``: the load in
  the coordinator's latest snapshot, as this process last heard it;
* ``raydp_rank_work{rank}``: tokens the rank has left to generate, for
  engines that report ``work()`` (what routing breaks ties by);
* ``raydp_rank_dead{rank}``: 1 while the coordinator reports the rank dead;
* ``raydp_rank_deaths_total{rank}``: live-to-dead changes this process saw
* ``raydp_rank_hangs_total{rank}``: those whose cause was a hang its watchdog caught
  (snapshots are looked at every ``WATCH_INTERVAL_S`` and at each scrape);
* ``raydp_api_server_info{client_index,client_count}``: which of the N
  processes sharing the port answered this scrape.

Each process counts only what it served: N processes behind one port are N
scrape targets (or one process per port, to scrape them apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Collection

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raydp.client.client import Client
from raydp.serve.rank_series import DEATHS, HANGS, DeathWatch, SnapshotCollector, count_deaths

WATCH_INTERVAL_S = 0.5
CLIENT_GONE = 499  # nginx's "client closed request": nobody received an answer
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ApiMetrics:
    """The metrics of one API server; the snapshot series come from ``client``."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "raydp_http_requests", "HTTP answers by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "raydp_http_request_duration_seconds",
            "arrival to last byte out, by route",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "raydp_time_to_first_token_seconds", "arrival to the first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tokens = Counter("raydp_generated_tokens", "tokens sent to clients", registry=r)
        self.deaths = Counter(*DEATHS, ["rank"], registry=r)
        self.hangs = Counter(*HANGS, ["rank"], registry=r)
        self._watch = DeathWatch()
        r.register(SnapshotCollector(client))

    def record_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def observe_deaths(self) -> None:
        """Count the ranks that went from live to dead since the last look (event-loop thread only)."""
        count_deaths(self._watch.new_deaths(self.client), self.deaths, self.hangs)

    @contextlib.asynccontextmanager
    async def watching(self, interval_s: float = WATCH_INTERVAL_S) -> AsyncIterator[None]:
        """Look at snapshots every ``interval_s`` while the app runs, so short deaths are counted too."""

        async def watch() -> None:
            while True:
                self.observe_deaths()
                await asyncio.sleep(interval_s)

        task = asyncio.ensure_future(watch())
        try:
            yield
        finally:
            task.cancel()

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, in the format ``accept`` asks for."""
        self.observe_deaths()
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class RequestMetrics:
    """ASGI middleware: counts every answer by route and status and times it.

    An answer is counted just before its last byte goes out, so a client that
    has read it and then scrapes ``/metrics`` finds it counted.
    """

    def __init__(self, app: ASGIApp, metrics: ApiMetrics, routes: Collection[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        start = time.perf_counter()
        status: int | None = None
        counted = False

        def count(final_status: int) -> None:
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.record_request(route, final_status, time.perf_counter() - start)

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                count(status or 500)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            # A stream cut short (the client hung up) keeps its status; no answer at all is a 500.
            count(status or 500)
