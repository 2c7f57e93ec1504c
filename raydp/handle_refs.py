"""How a :class:`~raydp.cluster.Cluster` handle is held, and what dropping it does.

A handle closes its cluster when the last reference to it goes (a client it
made holds one). So the backend's threads (death watchers, a silence watch or
an autoscaler mid-round, a restart) must hold its listeners weakly
(:func:`weakly`): a strong one would keep a dropped handle alive for as long
as they run, and its cluster would close at some later collection, on
whatever thread ran it. Its finalizer (:func:`close_all`) closes its clients.
What it made holds it strongly, on purpose: a client, and the API server
groups it started (serving ones keep their cluster, until they are dropped too).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import ParamSpec

from raydp.orchestration.owned import off_the_collectors_thread

P = ParamSpec("P")


def weakly(method: Callable[P, None]) -> Callable[P, None]:
    """``method`` (bound to a handle) held weakly: called while its handle lives, a no-op after."""
    ref = weakref.WeakMethod(method)

    def call(*args: P.args, **kwargs: P.kwargs) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)

    return call


def close_all(closers: list[Callable[[], None]]) -> None:
    """The handle's finalizer. The collector runs it in whatever thread it runs in, a client's own IO
    thread included (which cannot join itself), holding that thread's locks: off the main thread (where
    exit runs it) the clients are closed on a thread of their own."""
    work = list(closers)

    def run() -> None:
        for close in work:
            close()

    off_the_collectors_thread(run, "raydp-close-clients", daemon=True)
