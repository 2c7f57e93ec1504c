"""API server processes: a start that fails leaves nothing holding the port."""

from __future__ import annotations

import gc
import pickle
import socket

import pytest

from raydp.serve.processes import APIServerProcessManager
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints

pytestmark = pytest.mark.timeout(60)


def test_a_failed_start_releases_the_listening_port() -> None:
    endpoints = ClusterEndpoints("api", [], CoordinatorEndpoints("n", [], [], []), lockstep=False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unpicklable = lambda: None  # noqa: E731 - the child's arguments cannot be sent: spawning fails
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        APIServerProcessManager(endpoints, 1, host="127.0.0.1", port=port, node_id=unpicklable)  # type: ignore[arg-type]
    gc.collect()
    with socket.create_server(("127.0.0.1", port)):  # EADDRINUSE if the failed manager kept it
        pass
