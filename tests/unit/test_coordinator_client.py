"""``CoordinatorClient``: a notice that cannot reach the coordinator is logged, never raised, never blocks."""

from __future__ import annotations

import logging

import pytest

from raydp.coordinator.client import CoordinatorClient
from raydp.wire.endpoints import CoordinatorEndpoints
from raydp.wire.transport import SocketOptions

pytestmark = pytest.mark.timeout(30)


def _client() -> CoordinatorClient:
    # Port 9 (discard) on loopback: nothing accepts, so the send queue fills after one message.
    nowhere = ["tcp://127.0.0.1:9"]
    endpoints = CoordinatorEndpoints("n", nowhere, nowhere, nowhere)
    return CoordinatorClient(endpoints, "n", SocketOptions(high_water_mark=1))


@pytest.mark.timeout(30)  # a blocking send to a peer that never comes would wait forever: the timeout fails it
def test_undeliverable_notices_are_logged_once_each_and_do_not_block(caplog: pytest.LogCaptureFixture) -> None:
    client = _client()
    try:
        with caplog.at_level(logging.WARNING, logger="raydp.coordinator"):
            for rank in range(5):
                client.engine_dead(rank, "killed")
            client.engine_revived(7, ["tcp://127.0.0.1:1"])
        warnings = [r.getMessage() for r in caplog.records if r.name == "raydp.coordinator"]
        assert warnings, "a dropped notice must be logged"
        assert len(warnings) <= 6, "one warning per dropped notice"
        assert any("EngineDead(rank=" in w for w in warnings)
        assert any("EngineRevived(rank=7," in w for w in warnings)
    finally:
        client.close()


def test_a_notice_after_close_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    client = _client()
    client.close()
    with caplog.at_level(logging.WARNING, logger="raydp.coordinator"):
        client.engine_dead(3, "exited")
    assert "EngineDead(rank=3, cause='exited')" in caplog.text
