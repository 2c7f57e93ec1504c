"""``raydp serve`` as a user runs it: a child process, its banner, its URL, its ranks' processes, its end.

Its stderr goes to a file, not a pipe: a server that logs much (deaths,
restarts, Ray's own lines) would block on a full pipe nobody reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any

import psutil


class ServeProcess:
    """``raydp serve FLAGS`` started with a quiet log; :meth:`banner` waits for it to serve."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, cwd: str | None = None, **popen: Any) -> None:
        self.flags = flags
        root = cwd or os.getcwd()
        full_env = {**os.environ, "PYTHONPATH": root, "RAYDP_LOG_LEVEL": "WARNING", **(env or {})}
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in __exit__, read until then
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            [sys.executable, "-m", "raydp", "serve", *flags],
            env=full_env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=self._err,
            cwd=root,
            **popen,
        )
        self.url = ""
        self.retries: list[str] = []  # the lines saying a start failed and is tried again, before the banner

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` of :attr:`url`."""
        host, port = self.url.split("://")[1].split(":")
        return host, int(port)

    def stderr(self) -> str:
        """What it wrote to stderr so far."""
        self._err.seek(0)
        return str(self._err.read())

    def banner(self) -> str:
        """The banner line (its URL kept in :attr:`url`); fails naming the exit and stderr if none came."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        while "the start failed" in line:  # a start tried again (see retries)
            self.retries.append(line)
            line = self.proc.stdout.readline()
        if "Ctrl-C to stop" not in line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"no banner ({line!r}); exit {self.proc.returncode}: {self.stderr()[-3000:]}")
        self.url = line.split(" at ")[1].split(" ")[0]
        return line

    def rank_pid(self, name: str, rank: int) -> int:
        """The pid of engine rank ``rank`` of cluster ``name`` (its process title names both)."""
        title = f"raydp::{name} dp{rank} "
        seen = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                line = " ".join(child.cmdline())
            except psutil.Error as exc:
                line = repr(exc)
            if line.startswith(title):
                return int(child.pid)
            seen.append(line[:80])
        raise AssertionError(f"no process titled {title!r} among {seen}")

    def kill_rank(self, name: str, rank: int) -> int:
        pid = self.rank_pid(name, rank)
        os.kill(pid, signal.SIGKILL)
        return pid

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        """``GET url+path`` -> (status, JSON body or text), error statuses included."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()

    def stop(self, signum: int = signal.SIGINT, timeout: float = 60.0) -> tuple[int, str, str]:
        """``signum`` (if still running), then ``(returncode, stdout rest, stderr)``; killed past ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=10)
        return self.proc.returncode, out, self.stderr()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop()
        self._err.close()
