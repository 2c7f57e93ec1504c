"""An engine loop on a thread of its own, for the unit tests that drive one over real sockets."""

from __future__ import annotations

import threading
from typing import Any

from raydp.engine.loop import EngineLoop
from raydp.engine.sockets import EngineSockets


def run_loop(loop: EngineLoop, sockets: EngineSockets, broadcast: Any) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``loop`` on a daemon thread (its sockets closed when it ends) and wait until it subscribed to
    ``broadcast`` (an XPUB: the subscription arrives as a message); returns the thread and the errors list
    its run fills."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run()
        except BaseException as exc:
            errors.append(exc)
        finally:
            sockets.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert broadcast.poll(5000), "the engine subscribes to the broadcast socket"
    broadcast.recv()
    return thread, errors
