"""HTTP as clients speak it, to real API servers: the CLI as a subprocess, http.client, raw sockets.

No Ray here: these tests run the mp backend.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil


@dataclass
class Served:
    """A running ``raydp serve``: its process, its URL and the API server processes behind it."""

    proc: subprocess.Popen[str]
    url: str
    stderr_path: str

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None
        return parts.hostname, parts.port

    def api_server_pids(self) -> list[int]:
        """The children that accept on the port (the CLI itself only holds the socket)."""
        port = self.address[1]
        pids = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections()):
                    pids.append(child.pid)
        return pids


@contextlib.contextmanager
def raydp_serve(*flags: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """``raydp serve --backend mp --port 0 *flags`` until the block ends, then Ctrl-C (exit code 130)."""
    # stderr goes to a file: a pipe nobody reads would block the servers once full.
    with tempfile.NamedTemporaryFile("w+", prefix="raydp-serve-", suffix=".log", delete=False) as log:
        stderr_path = log.name
    full_env = {**os.environ, "PYTHONPATH": os.getcwd(), "RAYDP_LOG_LEVEL": "WARNING", **(env or {})}
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "raydp", "serve", "--backend", "mp", "--port", "0", *flags],
            env=full_env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        banner = _banner(proc)
        assert "Ctrl-C to stop" in banner, banner + Path(stderr_path).read_text()
        yield Served(proc, banner.split(" at ")[1].split(" ")[0], stderr_path)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.returncode == 130, Path(stderr_path).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(stderr_path)


def connection_to_each_api_server(served: Served, timeout_s: float = 60.0) -> dict[int, http.client.HTTPConnection]:
    """A kept-alive connection to each API server process, by pid.

    The processes share one listening socket and the kernel hands each new
    connection to one of them: connections are opened until every process
    holds one, each told by the process that owns its server end (bounded).
    """
    pids = served.api_server_pids()
    found: dict[int, http.client.HTTPConnection] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(pids) and time.monotonic() < deadline:
        conn = http.client.HTTPConnection(*served.address, timeout=120)
        conn.request("GET", "/health")  # answered: accepted by one process, which now holds it
        conn.getresponse().read()
        assert conn.sock is not None
        local = conn.sock.getsockname()[:2]
        owner = next((pid for pid in pids if _holds_peer(pid, local)), None)
        if owner is None or owner in found:
            conn.close()
        else:
            found[owner] = conn
    assert sorted(found) == sorted(pids), f"connections reached {sorted(found)} of {sorted(pids)}"
    return found


def _holds_peer(pid: int, address: tuple[str, int]) -> bool:
    """Whether process ``pid`` holds a connection whose peer is ``address`` (it accepted it)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return any(c.raddr and tuple(c.raddr) == address for c in psutil.Process(pid).net_connections())
    return False


def _banner(proc: subprocess.Popen[str]) -> str:
    """The line that says where it serves. On the Ray backend the ranks' own logs reach stdout too
    (an engine such as vLLM prints while it loads): skip them, then keep draining stdout in a
    thread, or the server would block on a full pipe."""
    assert proc.stdout is not None
    stdout = proc.stdout
    seen: list[str] = []
    for line in stdout:
        if "Ctrl-C to stop" in line:
            threading.Thread(target=lambda: all(stdout), daemon=True).start()
            return line
        seen = [*seen[-20:], line]
    return "".join(seen)  # the process ended first: what it said last


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    address: tuple[str, int],
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> Answer:
    """One request on a fresh connection (``body``: bytes as is, anything else as JSON)."""
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def health(address: tuple[str, int]) -> dict[str, Any]:
    answer = call(address, "GET", "/health", timeout=10)
    assert answer.status == 200, answer
    return dict(answer.json())


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float | None]:
    """What the server sends until it closes the connection, and when (seconds from now);
    None if it was still open after ``timeout``."""
    start = time.monotonic()
    deadline = start + timeout
    data = b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                return data, time.monotonic() - start
            data += chunk
    except ConnectionResetError:
        return data, time.monotonic() - start
    except TimeoutError:
        pass
    return data, None


def rss(pids: list[int]) -> int:
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


def shutting_down(body: dict[str, Any], grace_s: float) -> bool:
    """``body`` is the 503 a stopping API server gives a request still running after ``grace_s``."""
    error = body.get("error", {})
    return (error.get("type"), error.get("code")) == ("service_unavailable", "shutting_down") and (
        f"after graceful_shutdown_s={grace_s:g}" in error.get("message", "")
    )
