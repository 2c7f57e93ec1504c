"""The multi-host tests' driver process (:mod:`tests.integration.multihost_driver`), run on namespace hosts.

The hosts and their Ray nodes are :mod:`raydp.testing.ray_hosts`'s; this is
the test-only half: a driver that joins that Ray and answers JSON lines.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raydp.testing import netns
from raydp.testing.ray_hosts import Processes

REPO = Path(__file__).resolve().parents[2]
MARK = "@@multihost "  # starts the driver's reply lines (Ray may print on stdout too)


class Driver:
    """The multi-host driver process (:mod:`tests.integration.multihost_driver`): JSON lines in and out."""

    def __init__(self, procs: Processes, address: str, hosts: Sequence[netns.Host], env: Mapping[str, str]) -> None:
        self.procs = procs
        self.proc = procs.start(
            [
                sys.executable,
                "-m",
                "tests.integration.multihost_driver",
                "--address",
                address,
                "--hosts",
                ",".join(h.ip for h in hosts),
            ],
            "driver.log",
            env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=1,
            cwd=REPO,
        )
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK) :]))

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
