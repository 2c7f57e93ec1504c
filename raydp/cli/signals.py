"""Stopping a foreground command (``raydp serve``, ``raydp demo``) on SIGTERM as on Ctrl-C.

``kill -TERM`` is how systemd, Kubernetes and ``ray job stop`` end a
process, and a shell's background job (``raydp serve ... &``, ``nohup``)
starts with SIGINT ignored. So both signals are set explicitly, whatever was
inherited: the first one raises :class:`KeyboardInterrupt` in the main
thread, which closes the cluster the usual way (clients, API servers, actors,
groups, IPC directories); a second one exits at once, for an operator who
will not wait.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop(KeyboardInterrupt):
    """The first stop signal; ``signum`` says which, for the exit code (128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []


def _on_signal(signum: int, frame: FrameType | None) -> None:
    del frame
    if _received:
        print(f"raydp: {signal.Signals(signum).name} again: exiting now", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    _received.append(signum)
    raise Stop(signum)


def install_stop_handlers() -> None:
    """Route SIGINT and SIGTERM to :class:`Stop` (main thread only; call again after ``ray.init``)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signals reach the main thread only; an embedding program keeps its own handlers
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)
