"""``raydp status [NAME]``: what a running cluster looks like, read from its coordinator.

Lists the ranks with their nodes, devices and load (requests waiting and
running, and the tokens left to generate where the engine reports them), how
long each rank has been silent (a live one speaks every second; one silent past
``silence_timeout_s`` is ended as hung), the wave, deaths and restarts, and the
API servers with their URLs. Works for any
cluster running on the Ray cluster (launched detached, or by another process
that is still up); ``--json`` prints the same for machines. Creates nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from raydp.actors.attached import cluster_status, running_clusters
from raydp.actors.connection import connected
from raydp.names import NAMESPACE, coordinator_name
from raydp.placement.report import render_table
from raydp.wire.adapters import AdapterState
from raydp.wire.blocks import hit_rate
from raydp.wire.records import ClusterStatus

EXIT_NOT_FOUND = 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="show a running cluster: ranks, nodes, devices, load, wave, deaths, API servers",
        description="Read a running raydp cluster's state from its coordinator and print it "
        "(every cluster on the Ray cluster when NAME is left out). Creates nothing.",
    )
    p.add_argument("name", nargs="?", default=None, help="cluster name (default: every running cluster)")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS or the running cluster)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with connected(args.address, quiet=True):
        running = running_clusters()
        names = [args.name] if args.name else running
        if not names or (args.name and args.name not in running):
            print(_not_found(args.name, running, args.address), file=sys.stderr)
            return EXIT_NOT_FOUND
        reports = [describe_cluster(name) for name in names]
    print(json.dumps(reports, indent=2) if args.json else "\n\n".join(format_report(r) for r in reports))
    return 0


def _not_found(name: str | None, running: list[str], address: str | None) -> str:
    where = f"namespace {NAMESPACE!r} of the Ray cluster at {address or 'the ambient address'}"
    looked = f"a coordinator actor named {coordinator_name(name)!r}" if name else "coordinator actors"
    others = f"; running: {', '.join(running)}" if running else "; no raydp cluster is running there"
    return f"raydp status: looked for {looked} in {where}, found none{others}"


def describe_cluster(name: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """One cluster's endpoints, coordinator state and status info, as plain data (the ``--json`` report)."""
    return report(cluster_status(name, timeout_s))


def report(status: ClusterStatus) -> dict[str, Any]:
    state, info, endpoints = status.state, status.info, status.endpoints
    ranks = []
    if endpoints is not None and state.prefill_ranks > 0:  # the pools were resized: the coordinator knows last
        endpoints = msgspec.structs.replace(endpoints, prefill_ranks=state.prefill_ranks)
    for ep in endpoints.engines if endpoints is not None else []:
        r = ep.rank
        waiting, running = state.counts[r]
        ranks.append(
            {
                "rank": r,
                "pool": endpoints.pool(r) if endpoints is not None else "",
                "node_id": ep.node_id,
                "devices": info.devices[r] if r < len(info.devices) else [],
                "waiting": waiting,
                "running": running,
                "work": state.work[r] if r < len(state.work) and state.work[r] >= 0 else None,
                "prefix_cache_hit_rate": _hit_rate(state.prefix_cache, r),
                "adapters": _adapters(state.adapters, r),
                "deaths": state.deaths[r],
                "hangs": state.hangs[r] if r < len(state.hangs) else 0,
                "silent_s": _silent(state.silent_s, r),
                "restarts": state.restarts[r],
                "state": f"dead ({state.dead[r]})" if r in state.dead else "serving",
            }
        )
    down = sum(r["state"] != "serving" for r in ranks)
    return {
        "name": status.name,
        "dp_size": len(ranks),
        "health": "serving"
        if not down
        else (f"degraded ({down} of {len(ranks)} ranks down)" if down < len(ranks) else "down"),
        "wave": state.wave,
        "running": state.running,
        "lockstep": info.lockstep,
        "accelerator": info.accelerator or None,
        "engine": info.engine or None,
        "capacity": endpoints.capacity if endpoints is not None else None,
        "ranks": ranks,
        "api_servers": [msgspec.to_builtins(s) for s in info.api_servers],
        "autoscale": msgspec.to_builtins(info.autoscale) if info.autoscale is not None else None,
        "prefill_autoscale": msgspec.to_builtins(info.prefill_autoscale) if info.prefill_autoscale else None,
    }


def _silent(seconds: list[float], rank: int) -> float | None:
    """Seconds since the rank last spoke to the coordinator; None before its first word (or from an old one)."""
    if rank >= len(seconds) or seconds[rank] <= 0.0:
        return None
    return round(seconds[rank], 1)


def _hit_rate(counts: list[list[int]], rank: int) -> float | None:
    """The rank's prefix-cache hit rate (prompt tokens found cached), None where unknown."""
    if rank >= len(counts):
        return None
    rate = hit_rate(*counts[rank])
    return None if rate is None else round(rate, 4)


def _adapters(states: list[AdapterState], rank: int) -> dict[str, Any] | None:
    """The rank's LoRA adapters (held, least recently used first), slots and counts; None where none reported."""
    if rank >= len(states) or not states[rank].slots:
        return None
    a = states[rank]
    rate = round(a.hits / a.requests, 4) if a.requests else None
    return {"held": list(a.resident), "slots": a.slots, "loads": a.loads, "evictions": a.evictions, "hit_rate": rate}


def _adapter_lines(ranks: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in ranks:
        a = r.get("adapters")
        if a is not None:
            hits = "-" if a["hit_rate"] is None else f"{100 * a['hit_rate']:.0f}%"
            held = ", ".join(a["held"]) or "-"
            counts = [f"{len(a['held'])}/{a['slots']}", str(a["loads"]), str(a["evictions"])]
            rows.append([str(r["rank"]), *counts, hits, held])
    if not rows:
        return []
    header = ["rank", "held", "loads", "evictions", "hits", "adapters (least recently used first)"]
    return ["LoRA adapters:", *render_table(header, rows).split("\n")]


def format_report(report: dict[str, Any]) -> str:
    mode = "lockstep" if report["lockstep"] else "dense"
    pools = [r.get("pool", "") for r in report["ranks"]]
    if any(pools):
        mode += f", P/D {pools.count('prefill')} prefill + {pools.count('decode')} decode"
    wave = f"wave {report['wave']} ({'running' if report['running'] else 'paused'})"
    lines = [
        f"cluster {report['name']}: {report['dp_size']} ranks, {mode}, {wave}, "
        f"engine {report['engine']}, capacity {report['capacity']}, {report['health']}"
    ]
    header = ["rank", "node", "devices", "waiting", "running", "work", "cache hits", "silent", "deaths", "hangs"]
    rows = [[*header, "restarts", "state"]]
    if any(pools):
        rows[0].insert(1, "pool")
    for r in report["ranks"]:
        devices = f"{report['accelerator']} {','.join(r['devices'])}" if r["devices"] else "-"
        work = "-" if r.get("work") is None else str(r["work"])
        hits = "-" if r.get("prefix_cache_hit_rate") is None else f"{100 * r['prefix_cache_hit_rate']:.0f}%"
        silent = "-" if r.get("silent_s") is None else f"{r['silent_s']:.0f}s"
        rows.append(
            [
                str(r["rank"]),
                r["node_id"][:8],
                devices,
                str(r["waiting"]),
                str(r["running"]),
                work,
                hits,
                silent,
                str(r["deaths"]),
                str(r["hangs"]),
                str(r["restarts"]),
                r["state"],
            ]
        )
        if any(pools):
            rows[-1].insert(1, r["pool"])
    lines += render_table(rows[0], rows[1:]).split("\n")
    lines += _adapter_lines(report["ranks"])
    servers = report["api_servers"]
    lines.append("API servers:" + ("" if servers else " none"))
    for s in servers:
        ranks = "all ranks" if s.get("ranks") is None else "ranks " + ",".join(map(str, s["ranks"]))
        node = (s.get("node_id") or "?")[:8]
        lines.append(f"  {s['url']}  {s['mode']}, {s['count']} process(es) on node {node}, routing to {ranks}")
    for key in ("prefill_autoscale", "autoscale"):
        scaling = report.get(key)
        if scaling is not None:
            wants = f"wants {scaling['desired']}: {scaling['reason']}" if scaling["reason"] else "no change wanted"
            pool = f"{scaling['pool']} pool " if scaling.get("pool") else ""
            lines.append(f"autoscaler: {pool}{scaling['current']} ranks, {wants}")
    return "\n".join(lines)
