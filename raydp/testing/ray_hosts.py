"""Ray nodes started as processes of their own (``ray start --block``), on namespace hosts (:mod:`raydp.testing.netns`).

Each namespace host's node sees a private, empty raydp IPC root (a tmpfs over
``IpcDir.root()``), as another machine would: a rank that wrongly picked an
IPC path to reach another host fails here instead of quietly crossing the
shared filesystem.

Every process is started here with its own session (``start_new_session``),
so everything it spawns (GCS, raylets, workers; Ray changes process groups but
not sessions) is found by session id, and only those are ever killed; ``ray
stop`` would end other people's clusters. Each node gets its own
``--temp-dir``: nodes sharing one race for the same raylet socket name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import ray

from raydp.engine.gloo_interface import GLOO_IFNAME
from raydp.testing import netns
from raydp.wire.transport import IpcDir

RAY = str(Path(sys.executable).with_name("ray"))
SPAN_RESOURCE = "XPU"  # one per namespace host: a rank spanning hosts needs them fully free of its devices


def free_port(ip: str) -> int:
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


def wait_for_head(address: str, timeout_s: float = 60.0, head: subprocess.Popen[str] | None = None) -> None:
    """Until the head's GCS accepts connections at ``address``; TimeoutError past ``timeout_s``, or at once
    when the ``head`` process (if given) has exited."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError:
            if head is not None and head.poll() is not None:
                raise TimeoutError(f"the Ray head at {address} exited ({head.returncode}) before it answered") from None
            time.sleep(0.2)
    raise TimeoutError(f"no Ray head answered at {address} within {timeout_s:g}s")


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This environment without any ``RAY_*`` setting of the caller (an address, say), plus ``extra``.

    Ray's token auth is off explicitly: ``ray start --head`` turns it on when
    ``~/.ray/auth_token`` exists (any local ``ray.init`` writes one), while a
    driver given an address never does, so the driver would be refused. Nor
    does a host inherit the caller's gloo interface: raydp picks each host's own
    (:mod:`raydp.engine.gloo_interface`), and the caller's may be its loopback.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != GLOO_IFNAME}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", **extra}


class Processes:
    """The processes a test or tool started, and everything they spawned.

    They run in ``cwd`` (this process's working directory when None).
    """

    def __init__(self, workdir: Path, cwd: Path | None = None) -> None:
        self.workdir = workdir
        self.cwd = cwd
        self.children: list[subprocess.Popen[str]] = []
        self.hosts: list[netns.Host] = []
        self._logs: list[TextIO] = []

    def start(self, argv: Sequence[str], log: str, env: Mapping[str, str], **kw: Any) -> subprocess.Popen[str]:
        out = open(self.workdir / log, "w")  # noqa: SIM115 - closed in stop()
        self._logs.append(out)
        kw.setdefault("stdout", out)
        kw.setdefault("cwd", self.cwd)
        proc = subprocess.Popen(list(argv), stderr=out, env=dict(env), text=True, start_new_session=True, **kw)
        self.children.append(proc)
        return proc

    def start_head(self, ip: str, port: int, env: Mapping[str, str], timeout_s: float = 180.0) -> None:
        """Starts the head and returns once its GCS accepts connections: a node started sooner gives up
        after ``ray start``'s ~20 s of retries, and a busy machine can take longer than that to start a GCS."""
        # Ports Ray would otherwise take by default get free ones: another cluster on this host may hold those.
        head = self.start(
            [
                RAY,
                "start",
                "--head",
                "--block",
                f"--node-ip-address={ip}",
                f"--port={port}",
                f"--ray-client-server-port={free_port(ip)}",
                f"--dashboard-agent-listen-port={free_port(ip)}",
                "--include-dashboard=false",
                "--num-cpus=1",
                "--num-gpus=0",
                *self._node_args("head"),
            ],
            "head.log",
            env,
        )
        try:
            wait_for_head(f"{ip}:{port}", timeout_s, head)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; its log:\n{self.log_tail('head.log')}") from None

    def start_node(self, host: netns.Host, head: str, gpus: int, env: Mapping[str, str]) -> None:
        self.hosts.append(host)
        ipc_root = IpcDir.root()
        ipc_root.mkdir(mode=0o700, exist_ok=True)
        self.start(
            netns.in_namespace(
                host,
                [
                    RAY,
                    "start",
                    "--block",
                    f"--address={head}",
                    f"--node-ip-address={host.ip}",
                    "--num-cpus=4",
                    f"--num-gpus={gpus}",
                    f"--resources={json.dumps({SPAN_RESOURCE: 1})}",
                    *self._node_args(host.namespace),
                ],
                private=[ipc_root],
            ),
            f"{host.namespace}.log",
            env,
        )

    def _node_args(self, node: str) -> list[str]:
        return ["--disable-usage-stats", f"--object-store-memory={96 << 20}", f"--temp-dir={self.workdir / node}"]

    def alive(self) -> list[int]:
        """Live processes in this test's sessions or hosts' namespaces (zombies are not alive)."""
        sessions = {p.pid for p in self.children}
        found = {pid for host in self.hosts for pid in netns.namespace_pids(host)}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                stat = _stat(entry)
                if stat is not None and stat[3] in sessions:
                    found.add(int(entry.name))
        return sorted(pid for pid in found if (stat := _stat(Path(f"/proc/{pid}"))) and stat[0] != "Z")

    def stop(self, grace_s: float = 8.0) -> None:
        """SIGTERM every child (Ray nodes take their processes down), then SIGKILL whatever is left."""
        for proc in self.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.children:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in self._logs:
            log.close()

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.workdir / name
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _stat(proc_dir: Path) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, session) of a /proc entry, or None if it is gone."""
    try:
        raw = (proc_dir / "stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def node_ids_by_ip(hosts: list[str], timeout: float = 90.0) -> dict[str, str]:
    """The live nodes' ids by IP, once every host has joined (this process must be connected to the Ray)."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        if all(h in nodes for h in hosts):
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(f"hosts {hosts} did not all join Ray within {timeout}s; nodes seen: {nodes}")
        time.sleep(0.2)
