"""Unit tests are pure logic: starting Ray here is a bug."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _forbid_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    ray = sys.modules.get("ray")
    if ray is not None:

        def forbidden(*args: object, **kwargs: object) -> None:
            raise AssertionError("tests/unit must not call ray.init; use tests/integration")

        monkeypatch.setattr(ray, "init", forbidden)
