"""The directory N vLLM front-end processes share for prometheus_client's multiprocess mode.

A manager removes its directory when it closes. A manager that is killed
(SIGKILL, the OOM killer) cannot, so each directory's name carries its owner's
pid, and the next manager to start on the machine removes the directories of
owners that are gone. A directory whose owner lives, or whose name says nothing
of an owner, is left alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("raydp.api")

_OWNED = re.compile(r"raydp-.+-metrics-(?P<pid>\d+)-[^-]+$")


def make_metrics_dir(name: str, root: str | None = None) -> str:
    """A fresh directory for cluster ``name``'s front-ends, owned by this process; stale ones go first."""
    root = root or tempfile.gettempdir()
    sweep_stale_metrics_dirs(root)
    return tempfile.mkdtemp(prefix=f"raydp-{name}-metrics-{os.getpid()}-", dir=root)


def sweep_stale_metrics_dirs(root: str) -> list[str]:
    """Remove the metrics directories under ``root`` whose owning process is gone; the removed paths."""
    removed = []
    for path in Path(root).glob("raydp-*-metrics-*"):
        found = _OWNED.match(path.name)
        if found is None or not path.is_dir() or _alive(int(found["pid"])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    if removed:
        logger.info("removed %d metrics directories left by API server managers that were killed", len(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True
