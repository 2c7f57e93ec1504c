"""raydp's Grafana dashboard, generated from code with grafanalib so that it stays true.

Panels read two sources, both scraped by Prometheus:

* the API server processes' ``/metrics`` (HTTP requests, latency, time to
  first token, tokens sent), one series per process;
* Ray's metrics export on each node (``ray_`` + the name), where the
  coordinator publishes every rank's load, deaths, restarts, silence and the
  wave, and each engine its requests by outcome, tagged by ``cluster``.

:data:`PANELS` holds every query; :data:`LEFT_OUT` names each exported
metric family (the name without ``_total``, ``_bucket``, ...) the dashboard
does not chart, and why (a test checks that together
they cover everything a running cluster exports). ``raydp dashboard`` writes
the JSON; ``docs/grafana/raydp.json`` is its committed output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from grafanalib import core as g
from grafanalib._gen import DashboardEncoder

UID: Final = "raydp-overview"
RATE = "$__rate_interval"
CLUSTER = 'cluster=~"$cluster"'
_POOL = "{{cluster}} {{pool}}"  # a P/D cluster autoscales each pool: one line per pool


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str


def _quantiles(metric: str, by: str = "") -> tuple[Query, ...]:
    group = f"le{', ' + by if by else ''}"
    label = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Query(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RATE}])))", f"{label}p{int(q * 100)}")
        for q in (0.5, 0.99)
    )


def _per_rank(metric: str) -> Query:
    return Query(f"max by (cluster, rank) (ray_{metric}{{{CLUSTER}}})", "{{cluster}} rank {{rank}}")


PANELS: Final[tuple[Panel, ...]] = (
    Panel(
        "HTTP requests by route and status",
        "reqps",
        (Query(f"sum by (route, status) (rate(raydp_http_requests_total[{RATE}]))", "{{route}} {{status}}"),),
        "answers per second over every API server process",
    ),
    Panel(
        "HTTP errors by route",
        "reqps",
        (
            # "or ... * 0": a route with no error yet shows 0, not nothing.
            Query(
                f'sum by (route) (rate(raydp_http_requests_total{{status=~"[45].."}}[{RATE}])) '
                f"or sum by (route) (rate(raydp_http_requests_total[{RATE}])) * 0",
                "{{route}}",
            ),
        ),
        "4xx and 5xx answers per second (499: the client hung up)",
    ),
    Panel(
        "HTTP latency",
        "s",
        _quantiles("raydp_http_request_duration_seconds", "route"),
        "arrival to the last byte out, by route",
    ),
    Panel(
        "Time to first token",
        "s",
        _quantiles("raydp_time_to_first_token_seconds"),
        "arrival to the first token sent, over every API server",
    ),
    Panel(
        "Tokens sent",
        "short",
        (Query(f"sum(rate(raydp_generated_tokens_total[{RATE}]))", "tokens/s"),),
        "generated tokens per second sent to clients",
    ),
    Panel(
        "Stream migrations",
        "short",
        (Query(f"sum(increase(raydp_stream_migrations_total[{RATE}]))", "moved streams"),),
        "streams moved to a live rank after theirs died mid-stream (raydp serve --migration-limit)",
    ),
    Panel(
        "Engine requests by outcome",
        "reqps",
        (
            Query(
                f"sum by (cluster, outcome) (rate(ray_raydp_engine_requests_total{{{CLUSTER}}}[{RATE}]))",
                "{{cluster}} {{outcome}}",
            ),
        ),
        "requests added, finished and aborted per second, over every rank",
    ),
    Panel(
        "Waiting requests per rank",
        "short",
        (_per_rank("raydp_rank_waiting"),),
        "queued on the rank, from the coordinator's load snapshots",
    ),
    Panel("Running requests per rank", "short", (_per_rank("raydp_rank_running"),), "being stepped on the rank"),
    Panel(
        "Work per rank",
        "short",
        (_per_rank("raydp_rank_work"),),
        "tokens the rank has left to generate (engines that report work())",
    ),
    Panel(
        "Prefix-cache hit rate per rank",
        "percentunit",
        (_per_rank("raydp_rank_prefix_cache_hit_rate"),),
        "prompt tokens found in the rank's prefix cache, of those looked up (engines that report their cache)",
    ),
    Panel(
        "LoRA adapters per rank",
        "short",
        (
            Query(
                f"max by (cluster, rank) (ray_raydp_rank_adapters_held{{{CLUSTER}}})", "{{cluster}} rank {{rank}} held"
            ),
            Query(
                f"max by (cluster, rank) (ray_raydp_rank_adapter_loads{{{CLUSTER}}})", "{{cluster}} rank {{rank}} loads"
            ),
            Query(
                f"max by (cluster, rank) (ray_raydp_rank_adapter_evictions{{{CLUSTER}}})",
                "{{cluster}} rank {{rank}} evictions",
            ),
        ),
        "adapters held now; loads and evictions since the rank started: a steep climb means adapters swap in and out",
    ),
    Panel(
        "LoRA adapter hit rate per rank",
        "percentunit",
        (_per_rank("raydp_rank_adapter_hit_rate"),),
        "requests whose adapter the rank already held when they arrived, of those naming one",
    ),
    Panel(
        "Deaths and restarts per rank",
        "short",
        (
            Query(f"max by (cluster, rank) (ray_raydp_rank_deaths{{{CLUSTER}}})", "{{cluster}} rank {{rank}} deaths"),
            Query(
                f"max by (cluster, rank) (ray_raydp_rank_restarts{{{CLUSTER}}})", "{{cluster}} rank {{rank}} restarts"
            ),
            Query(f"max by (cluster, rank) (ray_raydp_rank_dead{{{CLUSTER}}})", "{{cluster}} rank {{rank}} dead now"),
        ),
        "since launch; 'dead now' is 1 while the rank is down",
    ),
    Panel(
        "Hung ranks",
        "short",
        (Query(f"max by (cluster, rank) (ray_raydp_rank_hangs{{{CLUSTER}}})", "{{cluster}} rank {{rank}} hangs"),),
        "deaths since launch whose cause was a hang: a loop turn outlived step_timeout_s, so raydp ended the rank",
    ),
    Panel(
        "Silence per rank",
        "s",
        (_per_rank("raydp_rank_silent_seconds"),),
        "seconds since the rank last spoke to the coordinator: a live rank speaks every second; one silent past "
        "silence_timeout_s is frozen (stopped, or stuck in native code), and raydp ends it as hung",
    ),
    Panel(
        "Request wave",
        "short",
        (Query(f"max by (cluster) (ray_raydp_wave{{{CLUSTER}}})", "{{cluster}}"),),
        "the lockstep wave number: rises as waves complete (dense clusters stay at 0)",
    ),
    Panel(
        "Autoscaler: ranks wanted and ranks running",
        "short",
        (
            Query(f"max by (cluster, pool) (ray_raydp_autoscale_desired_ranks{{{CLUSTER}}})", _POOL + " wanted"),
            Query(f"max by (cluster, pool) (ray_raydp_autoscale_current_ranks{{{CLUSTER}}})", _POOL + " running"),
        ),
        "clusters launched with autoscaling: the size the load asks for, and the size it found (per P/D pool)",
    ),
)

LEFT_OUT: Final[dict[str, str]] = {
    "raydp_api_server_info": "names the process that answered a scrape; a label source, not a chart",
    "raydp_rank_waiting": "the API servers' copy of the coordinator's snapshot; the panels read Ray's export",
    "raydp_rank_running": "as raydp_rank_waiting",
    "raydp_rank_work": "as raydp_rank_waiting",
    "raydp_rank_dead": "as raydp_rank_waiting",
    "raydp_rank_prefix_cache_hit_rate": "as raydp_rank_waiting",
    "raydp_rank_adapters_held": "as raydp_rank_waiting",
    "raydp_rank_adapter_loads": "as raydp_rank_waiting",
    "raydp_rank_adapter_evictions": "as raydp_rank_waiting",
    "raydp_rank_adapter_hit_rate": "as raydp_rank_waiting",
    "raydp_router_cached_blocks": "what one API server process knows of the ranks' caches: for debugging its routing",
    "raydp_router_in_flight": "the API servers' own count, per scrape target and with no cluster label; the load "
    "panels read the coordinator's, through Ray's export",
    "raydp_rank_deaths": "deaths each API server saw; ray_raydp_rank_deaths counts them once per cluster",
    "raydp_rank_hangs": "hangs each API server saw; ray_raydp_rank_hangs counts them once per cluster",
}


def queries() -> list[str]:
    return [q.expr for panel in PANELS for q in panel.queries]


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    width, height = 12, 8
    panels = [
        g.TimeSeries(
            title=p.title,
            description=p.description,
            dataSource="${datasource}",
            unit=p.unit,
            targets=[
                g.Target(expr=q.expr, legendFormat=q.legend, refId=chr(ord("A") + i), datasource="${datasource}")
                for i, q in enumerate(p.queries)
            ],
            gridPos=g.GridPos(h=height, w=width, x=(n % 2) * width, y=(n // 2) * height),
        )
        for n, p in enumerate(PANELS)
    ]
    templating = g.Templating(
        list=[
            g.Template(name="datasource", label="Data source", query="prometheus", type="datasource"),
            g.Template(
                name="cluster",
                label="raydp cluster",
                query="label_values(ray_raydp_rank_waiting, cluster)",
                dataSource="${datasource}",
                includeAll=True,
                multi=True,
                default="$__all",
                allValue=".*",
            ),
        ]
    )
    dashboard = g.Dashboard(
        title="raydp",
        uid=UID,
        description="raydp clusters: HTTP, ranks, waves",
        tags=["raydp"],
        timezone="browser",
        refresh="10s",
        panels=panels,
        templating=templating,
        time=g.Time("now-30m", "now"),
    )
    data: dict[str, Any] = json.loads(json.dumps(dashboard.to_json_data(), cls=DashboardEncoder))
    return data


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"
