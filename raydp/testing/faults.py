"""Fault injectors against a running raydp cluster on a local multi-node Ray, and the probes that time recovery.

:class:`LocalRay` is a ``ray.cluster_utils.Cluster`` with logical GPUs (a
head and worker nodes, one IP). :class:`Injector` kills what a raydp
cluster is made of, the way it dies in production:

* a rank's engine process: ``SIGKILL`` of its pid, or ``ray.kill``;
* a rank that hangs: its loop blocks for good in an engine call (engines with a
  ``hang_now`` utility, :mod:`raydp.testing.hangs`), and its watchdog must end it;
* a lockstep rank that stops joining its gang's all-reduces (``skip_all_reduces_now``):
  its peers' watchdogs must end them;
* a restart that wedges (``HangingEchoEngine`` with ``hang_in="restart"``): the
  rank is killed, and its successor's startup deadline must end the wedge;
* a device worker of a rank (engines with a ``worker_class``): ``SIGKILL``;
* the coordinator: ``SIGKILL`` or ``ray.kill``;
* an API server process (``cluster.serve_api``): ``SIGKILL``;
* a non-head node holding ranks: ``remove_node``, then a like node is added
  so the capacity comes back for its ranks to be re-placed on;
* on namespace hosts (``netns_ray.NetnsRay``, :data:`NETNS_KINDS`): a network
  partition of a host holding ranks (its veth goes down), then a fresh host
  is started so the capacity comes back.

Each returns a :class:`Fault` (what, which, when). :meth:`Injector.detected`
times the fault until the cluster's death report (``cluster.deaths`` grows);
:meth:`Injector.serving` tells whether what the fault hit serves again (a
request pinned to the rank answered correctly, the coordinator's subscribers
all back, the API server respawned and answering).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import ray
from ray.cluster_utils import Cluster as RayTestCluster

import raydp
from raydp.names import NAMESPACE, coordinator_name, rank_name
from raydp.serve.processes import APIServerProcessManager
from raydp.testing.ray_hosts import free_port

KINDS = (
    "rank-sigkill",
    "rank-ray-kill",
    "rank-hang",
    "worker-sigkill",
    "coordinator-sigkill",
    "coordinator-ray-kill",
    "api-server-sigkill",
    "node-remove",
)
HANG_CALL_TIMEOUT_S = 120.0
# On namespace hosts a partition takes the place of node removal (the test cluster's remove_node has no hosts there).
NETNS_KINDS = (*KINDS[:-1], "partition")
# Faults that need an engine made for them (raydp.testing.hangs): the failure table's rows, not the soaks'.
ENGINE_KINDS = ("rank-skip-allreduce", "restart-wedge")


# What a test Ray's head leaves out, to spare the cores: the Ray client server (Ray starts it only when
# given a port; nothing here connects with ray://), the log monitor (its only reader is a driver that logs
# its workers' output, and these drivers run with log_to_driver=False) and Ray's autoscaler monitor
# (raydp's own autoscaler is what scales here; nothing asks Ray's), and the dashboard (a head and ten module
# processes; the leftover checks read the GCS, and only the Jobs tests ask for one). The integration tests'
# Rays use it too.
LEAN_HEAD: dict[str, bool] = {"include_log_monitor": False, "no_monitor": True, "include_dashboard": False}


class LocalRay:
    """A local Ray of several nodes (logical GPUs), started and connected to by this driver."""

    def __init__(self, gpus_per_node: tuple[int, ...], cpus_per_node: int = 4, *, dashboard: bool = False) -> None:
        """``dashboard``: start Ray's dashboard, for those that use the Jobs API."""
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.cpus = cpus_per_node
        # The head's listeners that Ray binds at fixed defaults get free ports: another soak's or test's
        # local Ray may run on this machine at the same time (the dashboard looks for a free port itself).
        ports = {"dashboard_agent_listen_port": free_port("")}
        head = {"num_cpus": cpus_per_node, "num_gpus": gpus_per_node[0], **LEAN_HEAD, **ports}
        head["include_dashboard"] = dashboard
        self.cluster = RayTestCluster(initialize_head=True, head_node_args=head)
        self._gpus: dict[str, int] = {}  # worker node id -> its logical GPUs
        for gpus in gpus_per_node[1:]:
            self._add(gpus)
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.cluster.wait_for_nodes()

    @property
    def head_id(self) -> str:
        return str(self.cluster.head_node.node_id)

    def worker_nodes(self) -> list[Any]:
        return list(self.cluster.worker_nodes)

    def replace(self, node: Any) -> None:
        """Remove ``node`` (its processes die) and add a node with the same GPUs, so capacity comes back."""
        gpus = self._gpus.pop(node.node_id)
        self.cluster.remove_node(node)
        self._add(gpus)

    def _add(self, gpus: int) -> None:
        node = self.cluster.add_node(num_cpus=self.cpus, num_gpus=gpus)
        self._gpus[node.node_id] = gpus

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str  # e.g. "rank 2", "api server 1", "node 3f2a..."
    at: float  # time.monotonic() just before the kill
    ranks: tuple[int, ...] = ()  # the ranks it takes down (for the serving probe)
    deaths_before: int = 0
    api_index: int = -1
    old_pid: int = 0
    node: str = ""  # a partition's cut-off node: its ranks must come back elsewhere


class Injector:
    """Faults against ``cluster`` (launched by this driver) on ``local``; probes use a client of their own.

    ``echo``: the engines echo (a probe's answer must be its prompt); else any answer is one (a model's).
    """

    def __init__(
        self, cluster: raydp.Cluster, local: Any, servers: APIServerProcessManager | None = None, echo: bool = True
    ) -> None:
        self.cluster, self.local, self.servers, self.echo = cluster, local, servers, echo
        self.control = cluster.client()
        self.api_kills: list[float] = []
        self._lock = threading.Lock()

    # ---- faults ------------------------------------------------------------------------------

    def inject(self, kind: str, rank: int = 1, api_index: int = 0) -> Fault:
        if kind == "rank-sigkill":
            return self.kill_rank(rank)
        if kind == "rank-ray-kill":
            return self.ray_kill_rank(rank)
        if kind == "rank-hang":
            return self.hang_rank(rank)
        if kind == "rank-skip-allreduce":
            return self.skip_all_reduces(rank)
        if kind == "restart-wedge":  # an engine whose restarts wedge (HangingEchoEngine, hang_in="restart")
            return dataclasses.replace(self.kill_rank(rank), kind=kind)
        if kind == "worker-sigkill":
            return self.kill_worker(rank)
        if kind == "coordinator-sigkill":
            return self.kill_coordinator(sigkill=True)
        if kind == "coordinator-ray-kill":
            return self.kill_coordinator(sigkill=False)
        if kind == "api-server-sigkill":
            return self.kill_api_server(api_index)
        if kind == "node-remove":
            return self.remove_node()
        if kind == "coordinator-node-remove":  # a cluster launched with rank 0 on a worker node
            return dataclasses.replace(self.remove_node(), kind=kind)
        if kind == "partition":
            return self.partition_host(rank)
        raise ValueError(f"kind={kind!r}: not one of {(*KINDS, *ENGINE_KINDS, 'partition')}")

    def _fault(self, kind: str, target: str, **kw: Any) -> Fault:
        return Fault(kind, target, time.monotonic(), deaths_before=len(self.cluster.deaths), **kw)

    def kill_rank(self, rank: int) -> Fault:
        pid = int(self.control.call_utility(rank, "describe", timeout=10)["pid"])
        fault = self._fault("rank-sigkill", f"rank {rank} (pid {pid})", ranks=(rank,))
        os.kill(pid, signal.SIGKILL)
        return fault

    def ray_kill_rank(self, rank: int) -> Fault:
        actor = ray.get_actor(rank_name(self.cluster.name, rank), namespace=NAMESPACE)
        fault = self._fault("rank-ray-kill", f"rank {rank}", ranks=(rank,))
        ray.kill(actor, no_restart=True)
        return fault

    def hang_rank(self, rank: int) -> Fault:
        """Block the rank's loop for good (its engine's ``hang_now`` utility never returns): its watchdog
        must end it after ``step_timeout_s``. The call waits on a thread of its own until the rank is dead."""
        fault = self._fault("rank-hang", f"rank {rank}", ranks=(rank,))

        def call() -> None:
            try:
                self.control.call_utility(rank, "hang_now", timeout=HANG_CALL_TIMEOUT_S)
            except (raydp.RaydpError, TimeoutError):
                pass  # the rank's death fails the call: expected

        threading.Thread(target=call, name=f"hang-rank-{rank}", daemon=True).start()
        return fault

    def skip_all_reduces(self, rank: int) -> Fault:
        """A lockstep rank joins no more DP all-reduces (its engine's ``skip_all_reduces_now``): it runs on,
        and its peers wait in the collective until their watchdogs end them."""
        fault = self._fault("rank-skip-allreduce", f"rank {rank}", ranks=(rank,))
        self.control.call_utility(rank, "skip_all_reduces_now", timeout=10)
        return fault

    def kill_worker(self, rank: int) -> Fault:
        workers = self.control.call_utility(rank, "describe_workers", timeout=10)
        pid = int(workers[-1]["pid"])
        fault = self._fault(
            "worker-sigkill", f"worker tp{workers[-1]['tp_rank']} of rank {rank} (pid {pid})", ranks=(rank,)
        )
        os.kill(pid, signal.SIGKILL)
        return fault

    def kill_coordinator(self, sigkill: bool) -> Fault:
        actor = ray.get_actor(coordinator_name(self.cluster.name), namespace=NAMESPACE)
        if not sigkill:
            fault = self._fault("coordinator-ray-kill", "coordinator")
            ray.kill(actor, no_restart=True)
            return fault
        pid = self._actor_pid(actor)
        fault = self._fault("coordinator-sigkill", f"coordinator (pid {pid})")
        os.kill(pid, signal.SIGKILL)
        return fault

    def kill_api_server(self, index: int) -> Fault:
        assert self.servers is not None, "no API servers to kill"
        pid = self.servers.procs[index].process.pid
        assert pid is not None
        fault = self._fault("api-server-sigkill", f"api server {index} (pid {pid})", api_index=index, old_pid=pid)
        with self._lock:
            self.api_kills.append(fault.at)
        os.kill(pid, signal.SIGKILL)
        return fault

    def remove_node(self) -> Fault:
        """Remove a worker node holding ranks (never the head: the driver runs there); the coordinator too if
        it is there, beside rank 0."""
        by_node: dict[str, list[int]] = {}
        for ep in self.cluster.endpoints.engines:
            by_node.setdefault(ep.node_id, []).append(ep.rank)
        node = next(n for n in self.local.worker_nodes() if n.node_id in by_node)
        ranks = tuple(by_node[node.node_id])
        fault = self._fault("node-remove", f"node {node.node_id[:8]} (ranks {list(ranks)})", ranks=ranks)
        self.local.replace(node)
        return fault

    def partition_host(self, pick: int) -> Fault:
        """Cut off a namespace host holding ranks, never rank 0's.

        The coordinator is pinned beside rank 0 and a restarted one goes back to
        its predecessor's node, which a partition takes away for good: that
        fault is outside what the cluster recovers from.
        """
        by_node: dict[str, list[int]] = {}
        for ep in self.cluster.endpoints.engines:
            by_node.setdefault(ep.node_id, []).append(ep.rank)
        first = next(ep.node_id for ep in self.cluster.endpoints.engines if ep.rank == 0)
        nodes = sorted((n for n in by_node if n != first and n in self.local.hosts), key=lambda n: by_node[n])
        node = nodes[pick % len(nodes)]
        ranks = tuple(by_node[node])
        fault = self._fault(
            "partition", f"host {self.local.hosts[node].ip} (ranks {list(ranks)})", ranks=ranks, node=node
        )
        self.local.partition(node)
        return fault

    def settle(self, fault: Fault) -> None:
        """After ``fault`` was measured: a partition's replacement host joins and the cut-off host goes."""
        if fault.kind == "partition":
            self.local.reap()

    def node_with_ranks(self) -> bool:
        """Whether some worker node holds ranks (else ``node-remove`` has nothing to remove)."""
        held = {ep.node_id for ep in self.cluster.endpoints.engines}
        return any(n.node_id in held for n in self.local.worker_nodes())

    def server_killed_between(self, start: float, end: float) -> bool:
        """Whether an API server was killed while an HTTP request was on it."""
        with self._lock:
            return any(start - 0.05 <= at <= end for at in self.api_kills)

    @staticmethod
    def _actor_pid(actor: Any) -> int:
        from ray._private.state import actors

        for attempt in range(5):  # the GCS's actor table (no dashboard needed), until the pid is in
            found = actors(actor._actor_id.hex())  # noqa: SLF001 - a handle's id has no public accessor
            if found and found.get("Pid"):
                return int(found["Pid"])
            time.sleep(0.5 + attempt)
        raise RuntimeError(f"no pid for actor {actor}")

    # ---- probes ------------------------------------------------------------------------------

    def detected(self, fault: Fault) -> bool:
        if fault.kind == "partition":  # each cut-off rank reported dead because its node died
            told = {getattr(e, "rank", -1) for e in self.cluster.deaths[fault.deaths_before :] if "node died" in str(e)}
            return set(fault.ranks) <= told
        if fault.kind == "restart-wedge":  # not the kill: the successor's wedge, ended by its startup deadline
            return any(
                getattr(e, "cause", None) is raydp.DeathCause.INIT_FAILED
                for e in self.cluster.deaths[fault.deaths_before :]
            )
        return len(self.cluster.deaths) > fault.deaths_before

    def serving(self, fault: Fault) -> bool:
        """Whether what ``fault`` hit serves again."""
        if fault.kind.startswith("coordinator"):
            return self.coordinator_back() and self.rank_serves(0)
        if fault.kind.startswith("api-server"):
            return self.api_server_back(fault)
        if fault.kind == "partition" and any(
            self.cluster.endpoints.engines[r].node_id == fault.node for r in fault.ranks
        ):
            return False  # not re-placed yet
        return all(self.rank_serves(rank) for rank in fault.ranks)

    def rank_serves(self, rank: int, timeout: float = 5.0) -> bool:
        prompt = [rank + 1, 7]
        try:
            got = self.control.generate(prompt, max_tokens=2, rank=rank, timeout=timeout)
        except (raydp.RaydpError, TimeoutError):
            return False
        return bool(got == prompt) if self.echo else len(got) >= 1

    def coordinator_back(self) -> bool:
        try:
            state = self.cluster.coordinator_state()
        except Exception:  # the old actor is gone and the new one not there yet
            return False
        return len(state.subscribed) == self.cluster.dp_size

    def api_server_back(self, fault: Fault) -> bool:
        assert self.servers is not None
        proc = self.servers.procs[fault.api_index].process
        return proc.pid != fault.old_pid and proc.is_alive() and http_serves(self.servers.url, self.echo)

    def all_serving(self) -> bool:
        """Every rank answers, the coordinator has every subscriber, every API server process lives."""
        if not all(self.rank_serves(r) for r in range(self.cluster.dp_size)):
            return False
        if not self.coordinator_back():
            return False
        return self.servers is None or (
            all(p.process.is_alive() for p in self.servers.procs) and http_serves(self.servers.url, self.echo)
        )


def actor_processes(name: str) -> tuple[int, int]:
    """The largest RSS (bytes) and open-fd count among cluster ``name``'s live actor processes on this host."""
    import psutil
    from ray._private.state import actors

    rss = fds = 0
    for actor in actors(actor_state_name="ALIVE").values():  # the GCS's table: no dashboard needed
        if not str(actor["Name"] or "").startswith(f"{name}-") or not actor["Pid"]:
            continue
        try:
            proc = psutil.Process(int(actor["Pid"]))
            rss, fds = max(rss, proc.memory_info().rss), max(fds, proc.num_fds())
        except psutil.Error:  # died meanwhile (a fault)
            continue
    return rss, fds


def http_serves(url: str, echo: bool = True, timeout: float = 5.0) -> bool:
    """Whether the API servers at ``url`` answer a completion: the echo of its prompt, or (a model's) any."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": [3, 4], "max_tokens": 2, **({} if echo else {"return_token_ids": True})}),
            {"Content-Type": "application/json"},
        )
        answer = conn.getresponse()
        tokens = json.loads(answer.read())["choices"][0]["token_ids"] if answer.status == 200 else None
        return tokens is not None and (tokens == [3, 4] if echo else len(tokens) >= 1)
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return False
    finally:
        conn.close()


def wait_for(predicate: Callable[[], bool], since: float, timeout: float, poll_s: float = 0.015) -> float | None:
    """Seconds from ``since`` until ``predicate`` holds (polled every ``poll_s``), or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic() - since
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
