"""Metrics directories of killed API server managers are removed by the next manager; no live one's is.

Owners are real processes: one SIGKILLed (its lock goes with it), one alive while the sweep runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from raydp.serve.metrics_dir import LOCK, MetricsDir, sweep_stale_metrics_dirs

pytestmark = pytest.mark.timeout(60)
OWNER = """
import sys, time
from raydp.serve.metrics_dir import MetricsDir
d = MetricsDir(sys.argv[1], root=sys.argv[2])
open(d.path + "/counter_1.db", "wb").close()
print(d.path, flush=True)
time.sleep(60)
"""


@contextmanager
def owner(name: str, root: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A process that made a metrics directory and holds it."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER, name, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, Path(proc.stdout.readline().strip())
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_owners_directory_goes_and_a_living_owners_stays(tmp_path: Path) -> None:
    with owner("c", tmp_path) as (killed, killed_dir), owner("c", tmp_path) as (_, living_dir):
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        unowned = tmp_path / "raydp-c-metrics-q1w2e3"  # an older raydp's: no lock to judge by
        other = tmp_path / "not-raydp-metrics-x"
        unowned.mkdir()
        other.mkdir()
        assert (killed_dir / LOCK).exists() and (killed_dir / "counter_1.db").exists()

        assert sweep_stale_metrics_dirs(str(tmp_path)) == [str(killed_dir)]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (living_dir, unowned, other))
        assert (living_dir / "counter_1.db").exists(), "a live owner's files are untouched"


def test_a_new_directory_is_held_until_removed_and_clears_the_dead_first(tmp_path: Path) -> None:
    with owner("a-metrics-x", tmp_path) as (killed, killed_dir):  # a cluster named like the pattern
        killed.kill()
        killed.wait()
        made = MetricsDir("a-metrics-x", root=str(tmp_path))
        assert not killed_dir.exists() and Path(made.path).is_dir()
        assert Path(made.path).name.startswith("raydp-a-metrics-x-metrics-")
        assert sweep_stale_metrics_dirs(str(tmp_path)) == [], "its owner, this process, holds it"
        made.remove()
        made.remove()
        assert list(tmp_path.iterdir()) == []


def test_a_process_that_imported_prometheus_client_already_still_writes_its_metrics_there(tmp_path: Path) -> None:
    # As a front-end forked from a server that preloaded vLLM (and so prometheus_client) does.
    script = (
        "import sys, prometheus_client\n"
        "from raydp.serve.metrics_dir import use_metrics_dir\n"
        "use_metrics_dir(sys.argv[1])\n"
        "prometheus_client.Counter('raydp_probe', 'a probe').inc()\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=60)
    assert [p.name for p in tmp_path.glob("counter_*.db")], "the counter's value is in the shared directory"


def test_a_dead_servers_live_gauge_leaves_the_sum_once_forgotten(tmp_path: Path) -> None:
    # Two server processes each count a request in flight on rank 0, as raydp_router_in_flight does.
    script = (
        "import sys, prometheus_client\n"
        "from raydp.serve.metrics_dir import use_metrics_dir\n"
        "use_metrics_dir(sys.argv[1])\n"
        "g = prometheus_client.Gauge('raydp_probe_in_flight', 'a probe', ['rank'], multiprocess_mode='livesum')\n"
        "g.labels('0').set(1)\n"
        "print(__import__('os').getpid())\n"
    )
    made = MetricsDir("sum", root=str(tmp_path))
    try:
        command = [sys.executable, "-c", script, made.path]
        pids = [int(subprocess.check_output(command, text=True, timeout=60)) for _ in range(2)]
        assert _in_flight(made.path) == 2.0
        made.forget(pids[0])
        assert _in_flight(made.path) == 1.0, "the dead one's count is gone, the other's stays"
    finally:
        made.remove()


def _in_flight(path: str) -> float:
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    value = registry.get_sample_value("raydp_probe_in_flight", {"rank": "0"})
    return float(value or 0.0)
