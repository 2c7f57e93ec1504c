"""``raydp status``'s report and table from a coordinator's status, without a cluster."""

from __future__ import annotations

import pytest

from raydp.cli.status import format_report, report
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.records import ClusterInfo, ClusterStatus, CoordinatorStatus

pytestmark = pytest.mark.timeout(30)


def _status(silent_s: list[float], ranks: int | None = None) -> ClusterStatus:
    ranks = len(silent_s) if ranks is None else ranks
    coordinator = CoordinatorEndpoints(node_id="n" * 8, publish=[], collect=[], broadcast=[])
    endpoints = ClusterEndpoints(
        name="c",
        engines=[EngineEndpoint(rank=r, node_id=f"node{r}abc", input_addresses=[]) for r in range(ranks)],
        coordinator=coordinator,
        lockstep=False,
    )
    state = CoordinatorStatus(
        wave=0,
        running=False,
        dp_size=ranks,
        routable=ranks,
        hold=None,
        counts=[[0, 0]] * ranks,
        work=[-1] * ranks,
        dead={},
        deaths=[0] * ranks,
        restarts=[0] * ranks,
        dropped=0,
        broadcasts=0,
        subscribed=list(range(ranks)),
        resynced=True,
        silent_s=silent_s,
    )
    return ClusterStatus(name="c", endpoints=endpoints, state=state, info=ClusterInfo())


def test_each_ranks_silence_is_reported_in_seconds_and_a_rank_not_heard_yet_as_unknown() -> None:
    got = report(_status([0.44, 7.26, 0.0]))
    assert [r["silent_s"] for r in got["ranks"]] == [0.4, 7.3, None]
    rows = [line.split() for line in format_report(got).splitlines()]
    header = next(row for row in rows if row[:1] == ["rank"])
    column = header.index("silent") - 1  # "cache hits" is two words in the header, one cell in the rows
    assert [row[column] for row in rows if row[:1] in (["0"], ["1"], ["2"])] == ["0s", "7s", "-"]


def test_a_status_from_a_coordinator_without_silence_clocks_shows_none() -> None:
    got = report(_status([], ranks=2))  # an older coordinator's status: the field left at its default
    assert [r["silent_s"] for r in got["ranks"]] == [None, None]
