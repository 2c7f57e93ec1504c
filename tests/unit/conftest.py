"""Unit tests are pure logic: starting Ray here is a bug."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _forbid_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    ray = sys.modules.get("ray")
    if ray is not None:

        def forbidden(*args: object, **kwargs: object) -> None:
            raise AssertionError("tests/unit must not call ray.init; use tests/integration")

        monkeypatch.setattr(ray, "init", forbidden)


@pytest.fixture(autouse=True)
def _environment_as_found() -> Iterator[None]:
    """Each test leaves the process environment as it found it.

    Product code sets variables for the processes it starts (gloo's interface, vLLM's
    defaults), and a unit test runs that code in the test process. The integration
    tests run later in the same xdist worker, and what they start inherits the
    environment: a leaked ``GLOO_SOCKET_IFNAME=lo`` kept ranks on network-namespace
    hosts from meeting.
    """
    saved = dict(os.environ)
    yield
    for key in os.environ.keys() - saved.keys():  # only what changed: threads may read it meanwhile
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
