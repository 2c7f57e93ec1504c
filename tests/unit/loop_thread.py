"""A loop on a thread of its own, for the unit tests that drive one over real sockets."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from raydp.engine.loop import EngineLoop
from raydp.engine.sockets import EngineSockets

Started = tuple[threading.Thread, list[BaseException]]


def in_thread(run: Callable[[], object], after: Callable[[], object] = lambda: None) -> Started:
    """Start ``run`` on a daemon thread (``after`` once it ends); returns the thread and the errors it raised."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as exc:
            errors.append(exc)
        finally:
            after()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def run_loop(loop: EngineLoop, sockets: EngineSockets, broadcast: Any) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``loop`` on a daemon thread (its sockets closed when it ends) and wait until it subscribed to
    ``broadcast`` (an XPUB: the subscription arrives as a message); returns the thread and the errors list
    its run fills."""
    thread, errors = in_thread(loop.run, sockets.close)
    assert broadcast.poll(5000), "the engine subscribes to the broadcast socket"
    broadcast.recv()
    return thread, errors
