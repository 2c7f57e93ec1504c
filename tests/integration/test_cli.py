"""The command line as an operator uses it: --help, serve until Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from ray.cluster_utils import Cluster

from raydp.testing.serve_cli import ServeProcess
from tests.integration.helpers import socket_dirs


def raydp_cli(*args: str, extra_env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RAYDP_LOG_LEVEL": "WARNING", **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "raydp", *args], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw
    )  # type: ignore[call-overload]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["demo", "serve", "plan"])
def test_help_runs(command: str) -> None:
    proc = raydp_cli(command, "--help")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "usage: raydp " + command in out


@pytest.mark.timeout(120)
def test_serve_answers_http_and_ctrl_c_shuts_everything_down() -> None:
    flags = ("--backend", "mp", "--name", "clisrv", "--engine", "echo", "--api-servers", "2", "--port", "0")
    with ServeProcess(*flags) as server:
        server.banner()
        req = urllib.request.Request(
            f"{server.url}/v1/generate",
            json.dumps({"prompt_token_ids": [4], "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read()) == {"token_ids": [4, 4]}
        code, _, err = server.stop(signal.SIGINT, timeout=30)
    assert code == 130
    assert "stopped by SIGINT; everything was shut down" in err
    assert socket_dirs("clisrv") == []


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell does for `raydp serve ... &`, or nohup


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_sigterm_on_a_background_serve_shuts_everything_down(backend: str) -> None:
    import psutil

    name = f"bgterm{backend}"
    # On Ray, a local one of its own (not a test cluster that may be running): one rank of CPU bundles.
    on_ray = ("--address", "local", "--accelerator", "CPU", "--dp-size", "1") if backend == "ray" else ()
    flags = ("--backend", backend, "--name", name, "--engine", "echo", "--api-servers", "2", "--port", "0", *on_ray)
    with ServeProcess(*flags, preexec_fn=_ignore_sigint) as server:
        server.banner()
        req = urllib.request.Request(
            f"{server.url}/v1/generate",
            json.dumps({"prompt_token_ids": [6], "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read()) == {"token_ids": [6, 6]}
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert children, "the API servers (and, on mp, the engines) are child processes"
        code, _, stderr = server.stop(signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM; everything was shut down" in stderr
    assert "Traceback" not in stderr and "Aborted" not in stderr, stderr[-3000:]
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not [p for p in alive if p.name() != "raylet"], f"left behind: {alive}"
    assert socket_dirs(name) == []


def serve_banner(*flags: str, env: dict[str, str]) -> str:
    """Start ``raydp serve`` on the mp backend, read its banner, stop it with Ctrl-C."""
    with ServeProcess("--backend", "mp", "--engine", "echo", "--port", "0", *flags, env=env) as server:
        banner = server.banner()
        server.stop(signal.SIGINT, timeout=30)
        return banner


@pytest.mark.timeout(120)
def test_serve_takes_dp_size_from_the_environment_and_a_flag_wins() -> None:
    env = {"RAYDP_DP_SIZE": "3"}
    assert ": 3 ranks" in serve_banner("--name", "envsrv", env=env)
    assert ": 1 ranks" in serve_banner("--name", "envsrv", "--dp-size", "1", env=env)
    assert socket_dirs("envsrv") == []


@pytest.mark.timeout(180)
def test_demo_takes_dp_size_from_the_environment_and_a_flag_wins(two_nodes: Cluster) -> None:
    def launched(*flags: str) -> str:
        proc = raydp_cli(
            "demo",
            "--address",
            two_nodes.address,
            "--engine",
            "echo",
            "--accelerator",
            "CPU",
            "--requests",
            "12",
            "--no-progress",
            *flags,
            extra_env={"RAYDP_DP_SIZE": "3"},
        )
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        return out

    out = launched()
    assert "launched 3 ranks" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 "))]) == 3
    assert "launched 2 ranks" in launched("--dp-size", "2")
    out = launched("--prefill-dp-size", "1", "--decode-dp-size", "2")
    assert "launched 3 ranks of raydp.models.echo:EchoEngine (P/D: 1 prefill + 2 decode)" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("0 ", "1 ", "2 ")]
    served = {row[1]: 0 for row in rows}
    for row in rows:
        served[row[1]] += int(row[3])
    assert served == {"prefill": 12, "decode": 12}, out  # every request prefilled on one pool, decoded on the other


@pytest.mark.timeout(240)
def test_demo_with_tensor_parallel_size_2_shards_the_reference_lm_over_workers(two_nodes: Cluster) -> None:
    proc = raydp_cli(
        "demo", "--address", two_nodes.address, "--tensor-parallel-size", "2", "--requests", "12", "--no-progress"
    )
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 0, err
    assert "launched 2 ranks of raydp.models.tp_lm:TPLMEngine" in out
    assert "each rank shards over 2 device workers" in out
    assert "total: 12 requests, 192 tokens" in out


@pytest.mark.timeout(120)
def test_plan_takes_dp_size_from_the_environment_and_a_flag_wins(two_nodes: Cluster) -> None:
    def planned(*flags: str) -> dict[str, object]:
        proc = raydp_cli("plan", "--address", two_nodes.address, "--json", *flags, extra_env={"RAYDP_DP_SIZE": "3"})
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        return dict(json.loads(out))

    assert [r["rank"] for r in planned()["ranks"]] == [0, 1, 2]  # type: ignore[attr-defined]
    assert [r["rank"] for r in planned("--dp-size", "5")["ranks"]] == [0, 1, 2, 3, 4]  # type: ignore[attr-defined]
