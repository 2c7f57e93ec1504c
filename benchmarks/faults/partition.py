"""The failure table's partition row: a namespace host's link brought down under a driver's load.

Each trial starts a Ray over network-namespace hosts and runs the measuring
driver as ``python -m benchmarks.faults.extra --partition-driver`` (see that module's
docstring for what the row measures).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.faults.table import REPO, FaultRow, Tally, log
from raydp.testing import netns
from raydp.testing.fault_load import DriverLoad, Ledger, LoadShape
from raydp.testing.faults import wait_for
from raydp.testing.ray_hosts import Processes, clean_env, free_port, node_ids_by_ip

HEALTH_CHECK = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def nan_if_none(x: float | None) -> float:
    return math.nan if x is None else x


def partition_row(trials: int) -> FaultRow:
    label, happens = (
        "partition node",
        "its rank is reported dead 'node died' after Ray's health check gives up; "
        "re-placed on a spare host and restarted",
    )
    tally = Tally()
    reason = netns.unavailable()
    if reason is not None:
        tally.errors.append(f"skipped: {reason}")
        log(f"partition skipped: {reason}")
        return tally.row(label, happens)
    try:
        for trial in range(trials):
            result = _partition_trial(trial)
            log(f"partition #{trial + 1}: {result}")
            tally.detect_s.append(nan_if_none(result.get("detect_s")))
            tally.back_s.append(nan_if_none(result.get("back_s")))
            for key in ("requests", "lost", "typed", "bad"):
                setattr(tally, key, getattr(tally, key) + int(result.get(key, 0)))
            if result.get("error"):
                tally.errors.append(f"#{trial + 1}: {result['error']}")
    finally:
        netns.teardown()
        if netns.leftovers():
            tally.errors.append(f"namespaces left: {netns.leftovers()}")
    return tally.row(label, happens)


def _partition_trial(trial: int) -> dict[str, Any]:
    procs = Processes(Path(tempfile.mkdtemp(prefix=f"{netns.PREFIX}-ray-")), cwd=REPO)
    out = procs.workdir / "result.json"
    try:
        net = netns.create(3)
        env = clean_env(HEALTH_CHECK)
        port = free_port(net.bridge_ip)
        procs.start_head(net.bridge_ip, port, env)
        for host in net.hosts:
            procs.start_node(host, f"{net.bridge_ip}:{port}", gpus=1, env=env)
        driver = procs.start(
            [
                sys.executable,
                "-m",
                "benchmarks.faults.extra",
                "--partition-driver",
                "--address",
                f"{net.bridge_ip}:{port}",
                "--hosts",
                ",".join(f"{h.ip}={h.link}" for h in net.hosts),
                "--json",
                str(out),
            ],
            "driver.log",
            clean_env({}),
        )
        try:
            driver.wait(timeout=400)
        except subprocess.TimeoutExpired:
            return {"error": f"driver did not finish; log: {procs.log_tail('driver.log', 600)}"}
        if not out.exists():
            return {"error": f"driver exited {driver.returncode}: {procs.log_tail('driver.log', 600)}"}
        result: dict[str, Any] = json.loads(out.read_text())
        return result
    finally:
        procs.stop()
        netns.teardown()
        shutil.rmtree(procs.workdir, ignore_errors=True)
        from raydp.wire.transport import IpcDir

        for path in IpcDir.root().glob("fbpart-*"):  # the driver's own, had it been killed
            shutil.rmtree(path, ignore_errors=True)


def partition_driver(address: str, hosts: list[tuple[str, str]], out: Path) -> None:
    """One trial, in a process that joins the namespace Ray (this bench's process never does)."""
    import ray

    ray.init(address=address, log_to_driver=False)
    result: dict[str, Any] = {}
    try:
        result = _partition_measure(hosts)
    except Exception as exc:
        result = {"error": repr(exc)[:300]}
    finally:
        out.write_text(json.dumps(result))
        ray.shutdown()


def _partition_measure(hosts: list[tuple[str, str]]) -> dict[str, Any]:
    import raydp
    from raydp.errors import EngineDeadError

    nodes = node_ids_by_ip([ip for ip, _ in hosts])
    link_of = {nodes[ip]: link for ip, link in hosts}
    cluster = raydp.launch(
        name="fbpart",
        dp_size=2,
        dp_size_local=1,
        master_node_id=nodes[hosts[0][0]],
        accelerator="GPU",
        max_restarts=1,
        progress=False,
        engine_kwargs={"step_delay_s": 0.005},
    )
    ledger = Ledger()
    load = DriverLoad(cluster.client(), ledger, LoadShape(rate=6, concurrency=3, hung_after_s=30), 1)
    control = cluster.client()

    def rank1_serves() -> bool:
        try:
            return bool(control.generate([2, 7], max_tokens=2, rank=1, timeout=2.0) == [2, 7])
        except (raydp.RaydpError, TimeoutError):
            return False

    def rank1_dead() -> bool:
        return any(isinstance(e, EngineDeadError) and e.rank == 1 for e in cluster.deaths)

    stuck = 0
    try:
        load.start()
        time.sleep(1.5)
        old_node = cluster.endpoints.engines[1].node_id
        link = link_of[old_node]
        at = time.monotonic()
        netns.partition(netns.Host(0, "", "", link))
        detect = wait_for(rank1_dead, at, 60.0, 0.02)
        back = wait_for(rank1_serves, at, 120.0, 0.05)
        new_node = cluster.endpoints.engines[1].node_id
        time.sleep(1.5)
    finally:
        stuck = load.stop()
    bad = sum(ledger.total(o) for o in ("wrong", "duplicate", "untyped"))
    lost = ledger.lost() + stuck
    error = "" if back is not None else "rank 1 never served again"
    if new_node == old_node:
        error = error or "rank 1 not re-placed"
    if bad or lost:
        error = error or str(ledger.examples[:3])
    with contextlib.suppress(Exception):
        control.close()
    cluster.close()
    return {
        "detect_s": detect,
        "back_s": back,
        "requests": sum(ledger.submitted.values()),
        "lost": lost,
        "typed": ledger.total("typed"),
        "bad": bad,
        "error": error,
        "moved": f"{old_node[:8]} -> {new_node[:8]}",
        "deaths": [str(e)[:200] for e in cluster.deaths],
    }
