"""Ray nodes on separate hosts: CURVE over TCP between real addresses, and a network partition.

Every other multi-node test shares one IP. Here each worker node lives in its
own network namespace with its own IP on a bridge this test creates
(``raydp/testing/netns.py``), the head and the driver stay in the root
namespace on the bridge's IP, and so every byte between the driver and a rank
crosses a veth. The driver is a subprocess (``multihost_driver.py``): the
pytest process never joins this Ray cluster.

The head's GCS checks node health every 500 ms with a 1 s timeout and gives
up after 3 failures, so a cut-off node is declared dead within ~4.5 s.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from raydp.testing import netns
from raydp.testing.ray_hosts import Processes, clean_env, free_port
from raydp.wire.codec import encode
from raydp.wire.protocol import Request, RequestType
from raydp.wire.transport import IpcDir
from tests.integration.ray_hosts import Driver

HEALTH_CHECK = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
WINDOW_S = 3 * (0.5 + 1.0)  # failures x (period + timeout): the longest a dead node goes unnoticed
MARGIN_S = 10.0  # Ray turning the node's death into actor deaths, and raydp's watcher, on a busy 2-core box


@dataclass
class Hosts:
    net: netns.Network
    procs: Processes
    driver: Driver
    info: dict[str, Any]  # the driver's first report: nodes by IP, its own node and IP
    closed: bool = False

    def node(self, host: netns.Host) -> str:
        return str(self.info["nodes"][host.ip])

    def close(self) -> None:
        """Close the raydp clusters, kill every process started, remove the network (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            answer = self.driver.exit(timeout=60)
            if answer is not None:
                print(f"\nclusters closed: {answer['closed']}")
        finally:
            _release(self.procs)


def _release(procs: Processes) -> None:
    procs.stop()
    netns.teardown()
    shutil.rmtree(procs.workdir, ignore_errors=True)
    for path in IpcDir.root().glob("mh-*"):  # the driver's own, had it been killed
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    for stale in Path(tempfile.gettempdir()).glob(f"{netns.PREFIX}-ray-*"):
        shutil.rmtree(stale, ignore_errors=True)
    procs = Processes(Path(tempfile.mkdtemp(prefix=f"{netns.PREFIX}-ray-")))
    started = time.monotonic()
    try:
        net = netns.create(2)
        env = clean_env(HEALTH_CHECK)
        port = free_port(net.bridge_ip)
        procs.start_head(net.bridge_ip, port, env)
        for host in net.hosts:
            procs.start_node(host, f"{net.bridge_ip}:{port}", gpus=2, env=env)
        driver = Driver(procs, f"{net.bridge_ip}:{port}", net.hosts, clean_env({}))
        info = driver.expect(timeout=120)
    except BaseException:
        _release(procs)
        raise
    print(f"\nRay on 3 hosts, driver joined, in {time.monotonic() - started:.1f}s")
    state = Hosts(net, procs, driver, info)
    try:
        yield state
    finally:
        state.close()


@pytest.fixture(scope="module")
def dense(hosts: Hosts) -> dict[str, Any]:
    """A cluster of one rank per namespace host, kept for the module (the partition test ends rank 1)."""
    info = hosts.driver.call("launch", timeout=150, kind="dense")
    print(f"\ndense cluster launched in {info['seconds']:.1f}s")
    return info


def _tcp_parts(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _peers_of(host: netns.Host, port: int) -> list[str]:
    """Remote ends of the established TCP connections to ``port`` inside ``host``."""
    done = subprocess.run(
        netns.in_namespace(host, ["ss", "-Htn", "state", "established", f"( sport = :{port} )"]),
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return [line.split()[-1] for line in done.stdout.splitlines() if line.strip()]


def _plain_dealer_gets_an_answer(address: str) -> bool:
    """A DEALER without the cluster's keys sends a well-formed request, as any host on the network could."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDTIMEO, 2000)  # a refused handshake drops the pipe: a send would block for good
        sock.connect(address)
        try:
            sock.send_multipart([RequestType.ADD.value, encode(Request("outsider-1", [9], 2))])
        except zmq.Again:
            return False
        return bool(sock.poll(2000))
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(200)
def test_each_rank_serves_over_curve_tcp_at_its_own_hosts_ip(hosts: Hosts, dense: dict[str, Any]) -> None:
    net = hosts.net
    assert hosts.info["driver_ip"] == net.bridge_ip
    assert dense["curve"] is True
    engines = dense["engines"]
    assert [e["node_id"] for e in engines] == [hosts.node(h) for h in net.hosts], "one rank per host"
    assert dense["coordinator"]["node_id"] == hosts.node(net.hosts[0]), "the coordinator sits beside rank 0"
    tcp = [a for a in dense["coordinator"]["publish"] if a.startswith("tcp://")]
    assert [_tcp_parts(a)[0] for a in tcp] == [net.hosts[0].ip]

    answers = hosts.driver.call("generate", timeout=60, kind="dense")["answers"]
    assert answers == {str(r): [20 + r] * 3 for r in range(len(engines))}

    for engine, host in zip(engines, net.hosts, strict=True):
        ip, port = _tcp_parts(engine["picked"])
        assert ip == host.ip, f"rank {engine['rank']}: the driver must reach it at its host's IP, not {ip}"
        assert any(a.startswith("ipc://") for a in engine["input_addresses"]), "same-host peers keep IPC"
        # The driver's connection really arrives from the head host's IP, through the veth.
        assert any(peer.startswith(f"{net.bridge_ip}:") for peer in _peers_of(host, port)), _peers_of(host, port)
        with socket.create_connection((ip, port), timeout=5):
            pass  # a plain TCP connect from this host works...
        assert not _plain_dealer_gets_an_answer(engine["picked"]), "...but without the CURVE keys no answer comes"


@pytest.mark.timeout(200)
def test_lockstep_ranks_on_two_hosts_all_reduce_over_their_own_ips(hosts: Hosts, dense: dict[str, Any]) -> None:
    """Gloo binds where the hostname resolves unless told otherwise; here that is 127.0.0.1, unreachable
    from the other host, so the DP group forms only if raydp binds it to the node's IP."""
    info = hosts.driver.call("launch", timeout=150, kind="lockstep")
    assert [e["node_id"] for e in info["engines"]] == [hosts.node(h) for h in hosts.net.hosts]
    # every step and dummy batch all-reduces over the group, so answers prove it works
    assert hosts.driver.call("generate", timeout=60, kind="lockstep")["answers"] == {"0": [20] * 3, "1": [21] * 3}
    hosts.driver.call("close", timeout=60, kind="lockstep")


@pytest.mark.timeout(200)
def test_a_rank_spanning_two_hosts_steps_its_remote_worker_over_curve_tcp(hosts: Hosts, dense: dict[str, Any]) -> None:
    info = hosts.driver.call("launch", timeout=150, kind="span")
    call = hosts.driver.call
    workers = call("utility", timeout=60, kind="span", rank=0, method="describe_workers")["result"]
    assert [(w["tp_rank"], w["node_id"]) for w in workers] == [
        (t, hosts.node(h)) for t, h in enumerate(hosts.net.hosts)
    ], "one worker per host"
    assert info["engines"][0]["node_id"] == hosts.node(hosts.net.hosts[0])
    # each step goes to the worker on the other host through the channel (no IPC path reaches it there)
    assert call("generate", timeout=60, kind="span")["answers"] == {"0": [20] * 3}
    assert all(
        w["steps"] > 0 for w in call("utility", timeout=60, kind="span", rank=0, method="describe_workers")["result"]
    )
    # the workers' own device group (gloo on CPU) spans the hosts too
    assert call("utility", timeout=60, kind="span", rank=0, method="worker_all_reduce", args=[1.5])["result"] == [
        3.0,
        3.0,
    ]
    call("close", timeout=60, kind="span")


@pytest.mark.timeout(200)
def test_a_partitioned_hosts_rank_is_reported_dead_by_the_health_checks(hosts: Hosts, dense: dict[str, Any]) -> None:
    cut = hosts.net.hosts[1]
    hosts.driver.call("hold", timeout=30, kind="dense", rank=1)
    started = time.monotonic()
    netns.partition(cut)
    result = hosts.driver.call("await_death", timeout=120, kind="dense", rank=1, timeout_s=WINDOW_S + MARGIN_S + 30)
    elapsed = time.monotonic() - started
    print(
        f"\npartitioned host {cut.ip}: rank 1 reported dead after {elapsed:.1f}s (health-check window {WINDOW_S:.1f}s)"
    )
    dead = result["dead"]
    assert dead is not None, f"rank 1 never reported dead; deaths: {result['deaths']}"
    assert dead["rank"] == 1 and dead["node_id"] == hosts.node(cut), dead
    assert dead["cause"] == "node died", dead
    assert f"node {hosts.node(cut)[:12]}" in dead["message"], dead
    pending = result["pending"]
    assert pending["type"] == "EngineDeadError" and pending["rank"] == 1, pending
    assert "rank 1" in pending["message"], pending
    assert result["others"] == {"0": [20, 20, 20]}, "the rank on the connected host keeps serving"
    # No timing bound: nothing but Ray's health checks can notice a partition (the node's
    # processes live on), so a report at all, within await_death's bound, is their doing.


@pytest.mark.timeout(120)
def test_teardown_leaves_no_namespace_link_or_process(hosts: Hosts) -> None:
    procs = hosts.procs
    assert procs.alive(), "the hosts' processes run until now"
    hosts.close()
    assert netns.leftovers() == []
    assert procs.alive() == []
    assert all(p.poll() is not None for p in procs.children)
    assert not procs.workdir.exists()
