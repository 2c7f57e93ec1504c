"""Checks shared by the chaos soaks' tests: what a soak's JSON summary must show about its requests."""

from __future__ import annotations

from typing import Any


def assert_requests_accounted(summary: dict[str, Any], least_ok: int = 100) -> None:
    """Every driver and HTTP request ended in a known outcome, the load kept flowing, none lost or hung."""
    requests = summary["requests"]
    outcomes = requests["outcomes"]
    assert set(outcomes) == {"driver", "http"}
    for source, counts in outcomes.items():
        assert sum(counts.values()) == requests["submitted"][source], f"{source}: every request accounted for"
        assert counts["ok"] > least_ok, f"{source}: the load kept flowing"
        assert counts["wrong"] == counts["duplicate"] == counts["hung"] == counts["untyped"] == 0, counts
    assert requests["lost"] == 0 and requests["stuck_threads"] == 0
    migrated = requests["migrated"]  # streams that moved on a rank's death, each checked whole and in order
    assert set(migrated) == {"driver", "http"}
    assert all(m["moves"] >= m["streams"] >= 0 for m in migrated.values()), migrated
