"""Assertions about what a closed cluster left behind (the probes are :mod:`raydp.testing.leftovers`')."""

from __future__ import annotations

import psutil

from raydp.testing.leftovers import live_actors, live_groups, socket_dirs, wait_until

__all__ = ["assert_nothing_left", "live_actors", "live_groups", "running", "socket_dirs", "wait_until"]


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def assert_nothing_left(name: str, *, timeout: float = 15.0, wait_sockets: bool = False) -> None:
    """Cluster ``name`` left no live actor, no placement group and no socket directory.

    ``wait_sockets`` allows the directories time to go, for teardowns that
    happen in another process (a finalizer, an exiting driver) rather than in
    a ``close()`` that has returned.
    """
    assert wait_until(lambda: not live_actors(name), timeout=timeout), live_actors(name)
    assert live_groups(name) == []
    if wait_sockets:
        assert wait_until(lambda: socket_dirs(name) == []), socket_dirs(name)
    else:
        assert socket_dirs(name) == []
