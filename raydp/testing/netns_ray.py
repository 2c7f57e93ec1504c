"""A Ray cluster over network-namespace hosts for the chaos soak, which can partition a host and replace it.

The head runs in the root namespace on the bridge's IP (``10.213.7.1``) with
no GPU: the driver, its clients and the API servers live there. Every other
node is a namespace host (:mod:`raydp.testing.netns`) with its own IP on
``10.213.7.0/24``, 1 logical GPU and a private raydp IPC root, started with
``ray start --block`` (:mod:`raydp.testing.ray_hosts`) and Ray's health
check at 500 ms / 1 s timeout / 3 failures, so a partitioned host is declared
dead within seconds.

:meth:`NetnsRay.partition` brings a host's veth down (a partitioned raylet is
dead to Ray for good) and starts a fresh namespace host in its place, so the
next partition finds spare capacity again; :meth:`NetnsRay.reap` then kills
what still runs in the cut-off namespace and deletes it. :meth:`shutdown`
stops every process this class started (by session and namespace, never
``ray stop``) and removes every namespace and link, also after a failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import ray

from raydp.testing import netns
from raydp.testing.ray_hosts import Processes, clean_env, free_port, node_ids_by_ip

HEALTH_CHECK = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
JOIN_TIMEOUT_S = 90.0


class NetnsRay:
    """A head in the root namespace and ``hosts`` namespace hosts of 1 logical GPU each, joined by this driver."""

    def __init__(self, hosts: int) -> None:
        reason = netns.unavailable()
        if reason is not None:
            raise RuntimeError(f"--hosts netns needs network namespaces: {reason}")
        self.procs = Processes(Path(tempfile.mkdtemp(prefix=f"{netns.PREFIX}-chaos-")))
        self.hosts: dict[str, netns.Host] = {}  # node id -> host, live (not partitioned) ones only
        self._cut: list[netns.Host] = []  # partitioned, not yet reaped
        self._joining: list[netns.Host] = []  # replacements started, not yet seen by Ray
        self._next = hosts + 1
        try:
            net = netns.create(hosts)
            self.env = clean_env(HEALTH_CHECK)
            port = free_port(net.bridge_ip)
            self.address = f"{net.bridge_ip}:{port}"
            self.procs.start_head(net.bridge_ip, port, self.env)
            for host in net.hosts:
                self.procs.start_node(host, self.address, gpus=1, env=self.env)
            # The head runs without token auth (see clean_env); this driver must not ask for it either.
            os.environ.pop("RAY_ADDRESS", None)
            os.environ["RAY_AUTH_MODE"] = "disabled"
            ray.init(address=self.address, log_to_driver=False)
            ids = node_ids_by_ip([h.ip for h in net.hosts], JOIN_TIMEOUT_S)
            self.hosts = {ids[h.ip]: h for h in net.hosts}
        except BaseException:
            self.shutdown()
            raise

    @property
    def head_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def first_host(self) -> str:
        """The node id of the live host with the lowest index."""
        return min(self.hosts, key=lambda node: self.hosts[node].index)

    def partition(self, node_id: str) -> netns.Host:
        """Cut ``node_id``'s host off the network, and start a fresh host so the capacity comes back."""
        host = self.hosts.pop(node_id)
        netns.partition(host)
        self._cut.append(host)
        fresh = netns.add_host(self._next)
        self._next += 1
        self.procs.start_node(fresh, self.address, gpus=1, env=self.env)
        self._joining.append(fresh)
        return host

    def reap(self) -> None:
        """Wait for the replacements to join, then end what runs in cut-off hosts and delete their namespaces."""
        if self._joining:
            ids = node_ids_by_ip([h.ip for h in self._joining], JOIN_TIMEOUT_S)
            self.hosts.update({ids[h.ip]: h for h in self._joining})
            self._joining.clear()
        for host in self._cut:
            for pid in netns.namespace_pids(host):
                _kill(pid)
            netns.ip("netns", "delete", host.namespace, check=False)
        self._cut.clear()

    def leftovers(self) -> list[str]:
        """After :meth:`shutdown`: processes this class started that still live, and namespaces or links."""
        return [f"pid {p}" for p in self.procs.alive()] + [f"netns object {n}" for n in netns.leftovers()]

    def shutdown(self) -> None:
        try:
            ray.shutdown()
        finally:
            self.procs.stop()
            netns.teardown()
            shutil.rmtree(self.procs.workdir, ignore_errors=True)


def _kill(pid: int) -> None:
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
