"""wait_for_head: a node is started only once the head's GCS port accepts connections, never on a dead head."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from raydp.testing.ray_hosts import wait_for_head

pytestmark = pytest.mark.timeout(30)


def test_it_returns_once_the_port_accepts() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        wait_for_head(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=5)


def test_a_head_that_exited_fails_at_once_naming_its_exit_code() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: refused
        head = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], text=True)
        head.wait()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"exited \(3\) before it answered"):
            wait_for_head(f"127.0.0.1:{unused.getsockname()[1]}", timeout_s=20, head=head)
        assert time.monotonic() - started < 20, "it did not wait for the bound"


def test_no_answer_within_the_bound_is_a_timeout_naming_the_address() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"
        with pytest.raises(TimeoutError, match=f"no Ray head answered at {address} within 0.5s"):
            wait_for_head(address, timeout_s=0.5)
