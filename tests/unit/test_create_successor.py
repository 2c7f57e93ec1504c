"""Creating an actor under a name Ray has not released yet (raydp.actors.terminate.create_successor)."""

from __future__ import annotations

import time

import pytest

from raydp.actors.terminate import create_successor

pytestmark = pytest.mark.timeout(30)
TAKEN = ValueError("The name x-dp2 (namespace=raydp) is already taken. Please use a different name ...")


def test_a_name_released_a_moment_later_is_taken_then() -> None:
    attempts: list[float] = []

    def create() -> str:
        attempts.append(time.monotonic())
        if len(attempts) < 4:
            raise TAKEN
        return "actor"

    assert create_successor(create, timeout_s=5) == "actor"
    assert len(attempts) == 4


def test_a_name_held_for_good_is_reported_once_the_wait_ends() -> None:
    start = time.monotonic()
    calls = 0

    def create() -> str:
        nonlocal calls
        calls += 1
        raise TAKEN

    with pytest.raises(ValueError, match="already taken"):
        create_successor(create, timeout_s=0.5)
    assert calls > 1 and time.monotonic() - start < 15  # bounded by the 0.5 s timeout, with room for a busy machine


def test_any_other_error_is_raised_at_once() -> None:
    calls = 0

    def create() -> str:
        nonlocal calls
        calls += 1
        raise ValueError("bad resources")

    with pytest.raises(ValueError, match="bad resources"):
        create_successor(create, timeout_s=5)
    assert calls == 1
