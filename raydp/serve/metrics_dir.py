"""The directory N vLLM front-end processes share for prometheus_client's multiprocess mode.

A manager removes its directory when it closes. A manager that is killed
(SIGKILL, the OOM killer) cannot, so the next manager to start on the
machine removes what such managers left. Whether an owner is gone is told by
a lock, not a pid: the owner holds an exclusive ``flock`` on the directory's
``owner.lock`` for its whole life, and the kernel drops it when the owner
dies, however it dies. A pid would mislead where containers share ``/tmp``
but not their pid namespaces, and after pid reuse. A directory without the
lock file (an older raydp's, or one being made), another user's, or one
whose lock is held is left alone. prometheus_client reads only ``*.db``
files there, so the lock file is invisible to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger("raydp.api")

LOCK = "owner.lock"


class MetricsDir:
    """A fresh directory for cluster ``name``'s front-ends, owned (locked) by this process until :meth:`remove`.

    Stale directories under ``root`` go first (:func:`sweep_stale_metrics_dirs`).
    """

    def __init__(self, name: str, root: str | None = None) -> None:
        root = root or tempfile.gettempdir()
        sweep_stale_metrics_dirs(root)
        self.path = tempfile.mkdtemp(prefix=f"raydp-{name}-metrics-", dir=root)
        # Locked under a temporary name, then renamed: a sweeper never sees the lock file unlocked.
        making = os.path.join(self.path, f".{LOCK}")
        self._lock: int | None = os.open(making, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(making, os.path.join(self.path, LOCK))

    def forget(self, pid: int | None) -> None:
        """A server process died: its live gauges (``livesum`` and the like) no longer count in the sum."""
        if pid is not None:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self.path)  # type: ignore[no-untyped-call]

    def remove(self) -> None:
        """Remove the directory, then let go of it (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def sweep_stale_metrics_dirs(root: str) -> list[str]:
    """Remove this user's metrics directories under ``root`` whose owner is gone; the removed paths."""
    removed = []
    for path in Path(root).glob("raydp-*-metrics-*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to open
            if path.is_dir() and path.stat().st_uid == os.getuid() and _remove_if_unowned(path):
                removed.append(str(path))
    if removed:
        logger.info("removed %d metrics directories left by API server managers that were killed", len(removed))
    return removed


def _remove_if_unowned(path: Path) -> bool:
    fd = os.open(path / LOCK, os.O_RDWR)  # FileNotFoundError: no owner to judge by
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its owner lives
            return False
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()
    finally:
        os.close(fd)


def use_metrics_dir(path: str) -> None:
    """In a front-end process, before its first metric: keep prometheus_client's values under ``path``."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    values = sys.modules.get("prometheus_client.values")
    if values is not None:
        # Imported already (forked from a server that preloaded vLLM): prometheus_client picks its kind
        # of value once, at import, from this variable, and vLLM makes its metrics only later.
        values.ValueClass = values.get_value_class()  # type: ignore[attr-defined]
