"""The chaos soak's records and its summary table (:mod:`raydp.testing.chaos`)."""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import Any

from raydp.testing.faults import KINDS, NETNS_KINDS


@dataclass
class FaultRecord:
    kind: str
    target: str
    detect_s: float | None
    back_s: float | None


@dataclass
class Summary:
    seed: int
    minutes: float
    hosts: str = "local"
    kinds: tuple[str, ...] = KINDS
    faults: list[FaultRecord] = field(default_factory=list)
    requests: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def by_kind(self) -> dict[str, int]:
        return dict(collections.Counter(f.kind for f in self.faults))


def fmt(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.3f}s"


def median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s" if xs else "-"


def table(summary: Summary) -> list[str]:
    lines = [
        f"## chaos soak: seed {summary.seed}, {summary.minutes} min, {summary.hosts} hosts "
        f"({summary.wall_s} s with setup)",
        "",
        "| fault | injected | detect median | back median | back max |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in dict.fromkeys((*KINDS, *NETNS_KINDS)):
        recs = [f for f in summary.faults if f.kind == kind]
        if not recs and kind not in summary.kinds:
            continue
        detects = [f.detect_s for f in recs if f.detect_s is not None]
        backs = [f.back_s for f in recs if f.back_s is not None]
        lines.append(
            f"| {kind} | {len(recs)} | {median(detects)} | {median(backs)} | "
            f"{f'{max(backs):.3f} s' if backs else '-'} |"
        )
    lines += [
        "",
        "| source | submitted | ok | typed | wrong | duplicate | hung | untyped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for source, outcomes in summary.requests["outcomes"].items():
        lines.append(
            f"| {source} | {summary.requests['submitted'][source]} | "
            + " | ".join(str(outcomes[o]) for o in ("ok", "typed", "wrong", "duplicate", "hung", "untyped"))
            + " |"
        )
    migrated = summary.requests.get("migrated", {})
    lines += [
        "",
        "migrated streams (moves): "
        + ", ".join(f"{source} {m['streams']} ({m['moves']})" for source, m in migrated.items())
        + f"; the driver's client moved {summary.requests.get('driver_stream_moves', 0)} streams",
    ]
    res = summary.resources
    lines += [
        "",
        f"lost: {summary.requests['lost']}; driver RSS {res['driver_rss_mb'][0]} -> "
        f"{res['driver_rss_mb'][1]} MiB (max {res['driver_rss_max_mb']}), fds {res['driver_fds'][0]} -> "
        f"{res['driver_fds'][1]} (max {res['driver_fds_max']}); largest actor RSS "
        f"{res['actor_rss_max_mb'][0]} -> {res['actor_rss_max_mb'][1]} MiB, most actor fds "
        f"{res['actor_fds_max'][0]} -> {res['actor_fds_max'][1]}; "
        f"left after close: {summary.leftovers or 'nothing'}",
    ]
    lines.append("verdict: " + ("PASS" if not summary.violations else "FAIL: " + "; ".join(summary.violations)))
    return lines


__all__ = ["FaultRecord", "Summary", "fmt", "table"]
