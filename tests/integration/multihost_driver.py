"""A raydp driver for the multi-host tests, run as its own process.

The pytest process never joins the namespace Ray cluster (other integration
tests share in-process Ray clusters), so this driver does: it joins the Ray at
``--address``, waits for the namespace hosts (``--hosts``, their IPs) and then
answers commands, one JSON object per line on stdin, with one JSON line on
stdout that starts with ``ray_hosts.MARK`` (Ray may print too). Commands:

- ``launch {kind}``: a CURVE cluster named ``mh-<kind>`` over the hosts:
  ``dense`` (one rank per host), ``lockstep`` (the same, ranks in a gloo DP
  group) or ``span`` (one rank with a device worker on each host);
- ``generate {kind}``: every rank answers a short request;
- ``utility {kind, rank, method, args}``: a utility call on one rank;
- ``hold {kind, rank}``: start a long request on ``rank``, kept pending;
- ``await_death {kind, rank, timeout_s}``: wait until ``rank`` is reported
  dead, then say how the pending request failed and whether the others serve;
- ``close {kind}``; ``exit``: close every cluster, leave Ray and exit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any

import ray

import raydp
from raydp import Client
from raydp.errors import EngineDeadError
from raydp.testing.ray_hosts import SPAN_RESOURCE, node_ids_by_ip
from raydp.wire.transport import pick_address
from tests.integration.ray_hosts import MARK


def reply(**fields: Any) -> None:
    sys.stdout.write(MARK + json.dumps(fields) + "\n")
    sys.stdout.flush()


def config(kind: str, placed: list[str]) -> dict[str, Any]:
    """The launch fields of cluster ``kind``, ranks (or workers) placed on the hosts' nodes in order."""
    common: dict[str, Any] = {
        "name": f"mh-{kind}",
        "master_node_id": placed[0],
        "node_allowlist": tuple(placed),
        "auth": "curve",
        "transport": "auto",
        "progress": False,
    }
    if kind == "span":
        return {
            **common,
            "dp_size": 1,
            "tensor_parallel_size": len(placed),
            "placement_strategy": "span",
            "accelerator": SPAN_RESOURCE,
            "engine": "raydp.models.echo_workers:WorkerEchoEngine",
        }
    lockstep = kind == "lockstep"
    return {
        **common,
        "dp_size": len(placed),
        "dp_size_local": 1,
        "accelerator": "GPU",
        "lockstep": lockstep,
        "allreduce_interval": 4,
        "engine_kwargs": {"step_delay_s": 0.01, "collective": lockstep},
    }


class Driver:
    def __init__(self, hosts: list[str]) -> None:
        self.nodes = node_ids_by_ip(hosts)
        self.placed = [self.nodes[h] for h in hosts]
        self.node_id = ray.get_runtime_context().get_node_id()
        self.clusters: dict[str, raydp.Cluster] = {}
        self.clients: dict[str, Client] = {}
        self.pending: dict[tuple[str, int], Any] = {}

    def launch(self, kind: str) -> dict[str, Any]:
        started = time.monotonic()
        cluster = raydp.launch(**config(kind, self.placed))
        self.clusters[kind], self.clients[kind] = cluster, cluster.client()
        ep = cluster.endpoints
        return {
            "seconds": time.monotonic() - started,
            "curve": ep.curve is not None,
            "engines": [
                {
                    "rank": e.rank,
                    "node_id": e.node_id,
                    "input_addresses": e.input_addresses,
                    # the address this process's client connects to (what ClientSockets picks)
                    "picked": pick_address(e.input_addresses, same_node=e.node_id == self.node_id),
                }
                for e in ep.engines
            ],
            "coordinator": {"node_id": ep.coordinator.node_id, "publish": ep.coordinator.publish},
        }

    def generate(self, kind: str, ranks: list[int] | None = None) -> dict[str, list[int]]:
        client = self.clients[kind]
        ranks = list(range(self.clusters[kind].dp_size)) if ranks is None else ranks
        return {str(r): client.generate([20 + r], max_tokens=3, rank=r, timeout=30) for r in ranks}

    def await_death(self, kind: str, rank: int, timeout_s: float) -> dict[str, Any]:
        cluster = self.clusters[kind]
        started = time.monotonic()
        dead: EngineDeadError | None = None
        while dead is None and time.monotonic() - started < timeout_s:
            dead = next((e for e in cluster.deaths if isinstance(e, EngineDeadError) and e.rank == rank), None)
            time.sleep(0.05)
        if dead is None:
            return {"dead": None, "deaths": [str(e) for e in cluster.deaths]}
        seen_after = time.monotonic() - started
        try:
            self.pending.pop((kind, rank)).result(timeout=10)
            failure: dict[str, Any] = {"type": None}
        except Exception as exc:
            failure = {"type": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None)}
        return {
            "dead": {"rank": dead.rank, "node_id": dead.node_id, "cause": dead.cause.value, "message": str(dead)},
            "seconds": seen_after,
            "pending": failure,
            "others": self.generate(kind, [r for r in range(cluster.dp_size) if r != rank]),
            "deaths": [str(e) for e in cluster.deaths],
        }

    def close(self, kind: str) -> float:
        started = time.monotonic()
        self.clients.pop(kind).close()
        self.clusters.pop(kind).close()
        return time.monotonic() - started

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op, kind = cmd["op"], cmd.get("kind", "")
        if op == "launch":
            return self.launch(kind)
        if op == "generate":
            return {"answers": self.generate(kind)}
        if op == "utility":
            return {"result": self.clients[kind].call_utility(cmd["rank"], cmd["method"], *cmd.get("args", []))}
        if op == "hold":
            self.pending[kind, cmd["rank"]] = self.clients[kind].submit([7], max_tokens=1_000_000, rank=cmd["rank"])
            return {}
        if op == "await_death":
            return self.await_death(kind, cmd["rank"], cmd["timeout_s"])
        if op == "close":
            return {"seconds": self.close(kind)}
        raise ValueError(f"unknown op {op!r}")

    def serve(self) -> None:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            try:
                reply(ok=True, **self.handle(cmd))
            except Exception:
                reply(ok=False, error=traceback.format_exc())
        closed = {kind: self.close(kind) for kind in list(self.clusters)}
        reply(ok=True, closed=closed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--hosts", required=True, help="namespace host IPs, comma separated")
    args = parser.parse_args()
    ray.init(address=args.address, log_to_driver=False)
    try:
        try:
            driver = Driver(args.hosts.split(","))
        except Exception:
            reply(ok=False, error=traceback.format_exc())
            return
        reply(ok=True, nodes=driver.nodes, driver_node=driver.node_id, driver_ip=ray.util.get_node_ip_address())
        driver.serve()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
