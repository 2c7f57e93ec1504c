"""A Ray cluster over namespace hosts (:mod:`tests.integration.netns`), and a driver process for it.

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
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from raydp.wire.transport import IpcDir
from tests.integration import netns

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
MARK = "@@multihost "  # starts the driver's reply lines (Ray may print on stdout too)
SPAN_RESOURCE = "XPU"  # one per namespace host: a rank spanning hosts needs them fully free of its devices


def free_port(ip: str) -> int:
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This environment without any ``RAY_*`` setting of the caller (an address, say), plus ``extra``.

    Ray's token auth is off explicitly: ``ray start --head`` turns it on when
    ``~/.ray/auth_token`` exists (any local ``ray.init`` writes one), while a
    driver given an address never does, so the driver would be refused.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", **extra}


class Processes:
    """The processes this test started, and everything they spawned."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[subprocess.Popen[str]] = []
        self.hosts: list[netns.Host] = []
        self._logs: list[TextIO] = []

    def start(self, argv: Sequence[str], log: str, env: Mapping[str, str], **kw: Any) -> subprocess.Popen[str]:
        out = open(self.workdir / log, "w")  # noqa: SIM115 - closed in stop()
        self._logs.append(out)
        kw.setdefault("stdout", out)
        proc = subprocess.Popen(
            list(argv), stderr=out, env=dict(env), cwd=REPO, text=True, start_new_session=True, **kw
        )
        self.children.append(proc)
        return proc

    def start_head(self, ip: str, port: int, env: Mapping[str, str]) -> None:
        # Ports Ray would otherwise take by default get free ones: another cluster on this host may hold those.
        self.start([
            RAY, "start", "--head", "--block", f"--node-ip-address={ip}", f"--port={port}",
            f"--ray-client-server-port={free_port(ip)}", f"--dashboard-agent-listen-port={free_port(ip)}",
            "--include-dashboard=false", "--num-cpus=1", "--num-gpus=0", *self._node_args("head"),
        ], "head.log", env)

    def start_node(self, host: netns.Host, head: str, gpus: int, env: Mapping[str, str]) -> None:
        self.hosts.append(host)
        ipc_root = IpcDir.root()
        ipc_root.mkdir(mode=0o700, exist_ok=True)
        self.start(netns.in_namespace(host, [
            RAY, "start", "--block", f"--address={head}", f"--node-ip-address={host.ip}",
            "--num-cpus=4", f"--num-gpus={gpus}", f"--resources={json.dumps({SPAN_RESOURCE: 1})}",
            *self._node_args(host.namespace),
        ], private=[ipc_root]), f"{host.namespace}.log", env)

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
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


class Driver:
    """The multi-host driver process (:mod:`tests.integration.multihost_driver`): JSON lines in and out."""

    def __init__(self, procs: Processes, address: str, hosts: Sequence[netns.Host], env: Mapping[str, str]) -> None:
        self.procs = procs
        self.proc = procs.start(
            [sys.executable, "-m", "tests.integration.multihost_driver", "--address", address,
             "--hosts", ",".join(h.ip for h in hosts)],
            "driver.log", env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1,
        )
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK):]))

    def expect(self, timeout: float) -> dict[str, Any]:
        """The next reply; fails naming the driver's log when none comes (or the driver exits) or it is an error."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = self._replies.get(timeout=0.2)
                break
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._reader.join(timeout=2)  # its last lines may still be in the pipe
                gone = self.proc.poll() is not None and self._replies.empty()
                if gone or time.monotonic() > deadline:
                    raise AssertionError(
                        f"no answer from the driver (exit code {self.proc.poll()}); its log:\n"
                        f"{self.procs.log_tail('driver.log')}"
                    ) from None
        assert answer.get("ok"), answer.get("error")
        return answer

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it exited: expect() says so, with its log
        return self.expect(timeout)

    def exit(self, timeout: float) -> dict[str, Any] | None:
        """Ask the driver to close its clusters and exit; None if it had already gone."""
        if self.proc.poll() is not None:
            return None
        try:
            answer = self.call("exit", timeout)
        finally:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return answer
