"""Watching ``run()`` refs: a rank or the coordinator finishing means it died."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import ray

from raydp.actors.deaths import death_of
from raydp.errors import DeathCause, StartupError

WATCH_TIMEOUT_S = 0.05


def check_started(refs: dict[Any, int]) -> None:
    """Raise StartupError naming the first of ``refs`` that has finished (all should be running)."""
    if not refs:
        return
    done, _ = ray.wait(list(refs), num_returns=1, timeout=0)
    if not done:
        return
    rank = refs[done[0]]
    found = death_of(done[0])
    cause, detail = found if found is not None else (DeathCause.EXITED, "run() returned during startup")
    who = "the coordinator" if rank < 0 else f"engine rank {rank}"
    raise StartupError(f"{who} failed during startup ({cause.value}):\n{detail}")


def watch_run_refs(
    refs: dict[Any, int],
    stop: threading.Event,
    report: Callable[[int, DeathCause, str], None],
    incoming: queue.SimpleQueue[tuple[Any, int]],
    retired: set[Any] | None = None,
) -> None:
    """Report each ref that finishes, except ``retired`` ones (ranks a scale-down is removing)."""
    retired = retired if retired is not None else set()
    while not stop.is_set():
        while not incoming.empty():
            ref, rank = incoming.get()
            refs[ref] = rank
        if not refs:
            stop.wait(WATCH_TIMEOUT_S)
            continue
        done, _ = ray.wait(list(refs), num_returns=1, timeout=WATCH_TIMEOUT_S)
        for ref in done:
            rank = refs.pop(ref)
            if stop.is_set():
                return
            if ref in retired:
                retired.discard(ref)
                continue
            found = death_of(ref)
            cause, detail = found if found is not None else (DeathCause.EXITED, "run() returned")
            report(rank, cause, detail)
