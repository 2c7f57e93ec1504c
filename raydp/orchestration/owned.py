"""What one launch owns on the launching side: :class:`OwnedResources`, released exactly once.

Released by ``close()``, by garbage collection (:meth:`OwnedResources.collected`)
or at interpreter exit, whichever comes first; each backend subclasses it to
stop its components.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from raydp.wire.transport import IpcDir

logger = logging.getLogger("raydp.deaths")


@dataclass
class OwnedResources:
    """What one launch owns on the launching side; :meth:`release` runs once.

    Holds no reference to its backend, so that a ``weakref.finalize`` can
    release it. Subclasses stop their components in :meth:`stop_components`.
    """

    name: str = ""  # the launch's IPC prefix
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None
    ipc_dir: IpcDir | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        with self.lock:  # a restart in flight must not add components behind our back
            if self.released:
                return
            self.released = True
        self.stop.set()
        self.stop_components()
        for close in self.closers:
            try:
                close()
            except Exception:  # one failing closer must not leak the rest
                logger.exception("release step failed")
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        if self.ipc_dir is not None:
            self.ipc_dir.remove()

    def collected(self) -> None:
        """:meth:`release`, as its backend's finalizer runs it: on whatever thread collected the backend.

        That may be one of the backend's own threads, holding this launch's lock (a restart telling
        the listeners) or one :meth:`release` joins; off the main thread (where exit runs it) the
        release runs on a thread of its own.
        """
        # Not a daemon: an exit that comes meanwhile waits for it (its finalizer has run: exit will
        # not release this launch again).
        off_the_collectors_thread(self.release, f"raydp-release-{self.name}", daemon=False)

    def stop_components(self) -> None:
        """End the processes or actors this launch started (the backend's part)."""


def off_the_collectors_thread(work: Callable[[], None], name: str, *, daemon: bool) -> None:
    """Run a finalizer's ``work`` now on the main thread (where exit runs finalizers), else on a thread
    of its own: the collector runs finalizers on whatever thread it runs on, which may hold locks the
    work takes, or be a thread the work joins."""
    if threading.current_thread() is threading.main_thread():
        work()
        return
    try:
        threading.Thread(target=work, name=name, daemon=daemon).start()
    except RuntimeError:  # the interpreter is shutting down: no new thread starts
        work()


__all__ = ["OwnedResources", "off_the_collectors_thread"]
