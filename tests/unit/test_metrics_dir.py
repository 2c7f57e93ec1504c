"""Metrics directories of killed API server managers are removed by the next manager; no one else's are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raydp.serve.metrics_dir import make_metrics_dir, sweep_stale_metrics_dirs

pytestmark = pytest.mark.timeout(30)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_owners_directory_goes_and_a_living_owners_stays(tmp_path: Path) -> None:
    killed = tmp_path / f"raydp-c-metrics-{dead_pid()}-abc123"
    living = tmp_path / f"raydp-c-metrics-{os.getpid()}-def456"
    unowned = tmp_path / "raydp-c-metrics-q1w2e3"  # an older raydp's name: no owner to judge by
    other = tmp_path / "not-raydp-metrics-1-x"
    for path in (killed, living, unowned, other):
        path.mkdir()
    (killed / "counter_1.db").write_bytes(b"x")

    assert sweep_stale_metrics_dirs(str(tmp_path)) == [str(killed)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (living, unowned, other))


def test_a_new_directory_names_its_owner_and_clears_the_dead_first(tmp_path: Path) -> None:
    killed = tmp_path / f"raydp-a-metrics-x-metrics-{dead_pid()}-zz9"  # a cluster named like the pattern
    killed.mkdir()
    made = Path(make_metrics_dir("a-metrics-x", root=str(tmp_path)))
    assert made.is_dir() and made.name.startswith(f"raydp-a-metrics-x-metrics-{os.getpid()}-")
    assert not killed.exists()
    assert sweep_stale_metrics_dirs(str(tmp_path)) == []  # its owner, this process, lives
