"""The driver of ``test_autoscaler.py``: run against a fake autoscaling Ray, prints what it saw as JSON.

It launches an autoscaling raydp cluster of 1 rank (a GPU node each), holds 6
requests in flight (3 ranks wanted), then stops the load, and records the
sizes, the nodes each rank landed on, and the GPU nodes Ray kept.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import ray

import raydp

NAME = "fakeauto"
SCALING = {
    "min_dp_size": 1,
    "max_dp_size": 3,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 3.0,
    "look_back_s": 1.0,
    "interval_s": 0.25,
    "drain_timeout_s": 20.0,
}


def gpu_nodes() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)


def wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def main(address: str) -> dict[str, Any]:
    ray.init(address=address)
    # The autoscaler starts the one worker node min_workers asks for.
    if not wait_until(lambda: len(gpu_nodes()) == 1, timeout=120):
        raise RuntimeError(f"the fake autoscaler started no GPU node: {ray.nodes()}")
    seen: dict[str, Any] = {"nodes_at_start": gpu_nodes()}
    cluster = raydp.launch(
        name=NAME,
        dp_size=1,
        progress=False,
        autoscaling=SCALING,
        placement_timeout_s=120,
        engine_kwargs={"step_delay_s": 0.01},
    )
    stop = threading.Event()
    outcomes: list[str] = []

    def send(client: raydp.Client) -> None:
        while not stop.is_set():
            handle = client.submit([3], max_tokens=20)
            try:
                outcomes.append("ok" if handle.result(timeout=120) == [3] * 20 else "wrong tokens")
            except Exception as exc:
                outcomes.append(repr(exc))

    senders = [threading.Thread(target=send, args=(cluster.client(),), daemon=True) for _ in range(6)]
    try:
        seen["rank_nodes_at_start"] = [r.node_id for r in cluster._manager.slots]
        for thread in senders:
            thread.start()
        seen["grew"] = wait_until(lambda: cluster.dp_size == 3, timeout=240)
        seen["rank_nodes_at_peak"] = [r.node_id for r in cluster._manager.slots]
        seen["nodes_at_peak"] = gpu_nodes()
        stop.set()
        for thread in senders:
            thread.join(timeout=120)
        seen["shrank"] = wait_until(lambda: cluster.dp_size == 1, timeout=120)
        seen["nodes_removed"] = wait_until(lambda: len(gpu_nodes()) == 1, timeout=180)
        seen["nodes_at_end"] = gpu_nodes()
        seen["answer_at_end"] = cluster.client().generate([4], max_tokens=2)
    finally:
        stop.set()
        cluster.close()
    seen["outcomes"] = {o: outcomes.count(o) for o in set(outcomes)}
    seen["actors_left"] = [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(f"{NAME}-")
    ]
    seen["groups_left"] = [
        g["name"]
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith(f"{NAME}-") and g["state"] != "REMOVED"
    ]
    return seen


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
