"""The command line as an operator uses it: --help, serve until Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.integration.helpers import socket_dirs


def raydp_cli(*args: str, **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RAYDP_LOG_LEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "raydp", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # type: ignore[call-overload]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["demo", "serve", "plan"])
def test_help_runs(command: str) -> None:
    proc = raydp_cli(command, "--help")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "usage: raydp " + command in out


@pytest.mark.timeout(120)
def test_serve_answers_http_and_ctrl_c_shuts_everything_down() -> None:
    proc = raydp_cli("serve", "--backend", "mp", "--name", "clisrv", "--engine", "echo",
                     "--api-servers", "2", "--port", "0")
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert "Ctrl-C to stop" in banner, banner + (proc.stderr.read() if proc.poll() is not None else "")
        url = banner.split(" at ")[1].split(" ")[0]
        req = urllib.request.Request(f"{url}/v1/generate", json.dumps({"prompt_token_ids": [4], "max_tokens": 2})
                                     .encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read()) == {"token_ids": [4, 4]}
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in proc.stderr.read()
    assert socket_dirs("clisrv") == []
