"""A Ray cluster whose autoscaler adds and removes local nodes (Ray's ``fake_multinode`` provider).

``ray.cluster_utils.AutoscalingCluster`` cannot start from Ray 2.60's wheel
(its example config is missing) and runs ``ray stop --force``, which would
end every other Ray on the machine. So the head is started here with a
config of our own, in a session of its own (:class:`~raydp.testing.ray_hosts.Processes`),
and everything it spawned, the nodes its autoscaler adds included, ends
with that session.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import ray

from raydp.testing.ray_hosts import RAY, Processes, clean_env, free_port

HEAD_TYPE = "ray.head.default"
WORKER_TYPE = "ray.worker.gpu"


def autoscaling_config(
    gcs: str, *, worker_cpus: int, worker_gpus: int, min_workers: int, max_workers: int, idle_minutes: float
) -> dict[str, Any]:
    """A head with no GPU and one worker type with ``worker_gpus`` GPUs, ``min_workers`` of them kept."""
    return {
        "cluster_name": "raydp-fake",
        "max_workers": max_workers,
        "upscaling_speed": 10.0,
        "idle_timeout_minutes": idle_minutes,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs,
        },
        "available_node_types": {
            HEAD_TYPE: {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {
                "resources": {"CPU": worker_cpus, "GPU": worker_gpus},
                "node_config": {},
                "min_workers": min_workers,
                "max_workers": max_workers,
            },
        },
        "head_node_type": HEAD_TYPE,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "auth": {"ssh_user": "ray"},
        "docker": {},
    }


def start(
    workdir: Path,
    *,
    worker_cpus: int = 2,
    worker_gpus: int = 1,
    min_workers: int = 1,
    max_workers: int = 3,
    idle_minutes: float = 0.2,
) -> tuple[Processes, str]:
    """Start the head (its autoscaler reads demand every second); returns its processes and address."""
    ip = ray.util.get_node_ip_address()
    port = free_port(ip)
    address = f"{ip}:{port}"
    config = workdir / "autoscaling.json"  # YAML is a superset of JSON
    config.write_text(
        json.dumps(
            autoscaling_config(
                address,
                worker_cpus=worker_cpus,
                worker_gpus=worker_gpus,
                min_workers=min_workers,
                max_workers=max_workers,
                idle_minutes=idle_minutes,
            )
        )
    )
    procs = Processes(workdir)
    env = clean_env({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    procs.start(
        [
            RAY,
            "start",
            "--head",
            "--block",
            f"--node-ip-address={ip}",
            f"--port={port}",
            f"--autoscaling-config={config}",
            f"--ray-client-server-port={free_port(ip)}",
            f"--dashboard-agent-listen-port={free_port(ip)}",
            "--include-dashboard=false",
            "--num-cpus=2",
            "--num-gpus=0",
            "--disable-usage-stats",
            f"--object-store-memory={96 << 20}",
            f"--temp-dir={workdir / 'head'}",
        ],
        "head.log",
        env,
    )
    return procs, address


def stop(procs: Processes, timeout_s: float = 30.0) -> list[int]:
    """End the fake cluster: its autoscaler may start a node while the others go, so kill until
    none is left (bounded); returns what is still alive (nothing, normally)."""
    import os
    import signal

    procs.stop()
    deadline = time.monotonic() + timeout_s
    while (alive := procs.alive()) and time.monotonic() < deadline:
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return procs.alive()
