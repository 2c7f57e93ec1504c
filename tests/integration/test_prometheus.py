"""A real Prometheus scrapes a running ``raydp serve`` under load, and every dashboard query returns data.

Debian's ``prometheus`` (installed here where missing) scrapes the two
sources the dashboard reads: the API servers' ``/metrics`` and Ray's metrics
export of the head node that hosts the coordinator and the ranks. The Ray
head and Prometheus run in sessions of their own, found and ended by session
id; ``raydp serve`` ends with Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from ray.util import get_node_ip_address

from raydp.dashboard import LEFT_OUT, queries
from raydp.testing.ray_hosts import RAY, Processes, clean_env, free_port
from tests.integration.helpers import wait_until
from tests.integration.http_helpers import Served, raydp_serve

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]
NAME = "promdash"
IP = "127.0.0.1"  # Prometheus and the API servers


def prometheus_binary() -> str:
    """Debian's prometheus, installed with apt where it is missing (CI machines start without it)."""
    found = shutil.which("prometheus")
    if found is None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
        if subprocess.run(install, check=False, env=env, capture_output=True, timeout=300).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300, check=True)
            subprocess.run(install, env=env, capture_output=True, timeout=300, check=True)
        found = shutil.which("prometheus")
    assert found is not None, "prometheus is installed"
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, str]]:
    """A Ray head, ``raydp serve`` on it (2 ranks, 2 API servers), and Prometheus scraping both."""
    binary = prometheus_binary()
    workdir = tmp_path_factory.mktemp("prometheus")
    procs = Processes(workdir)
    node_ip = get_node_ip_address()  # a driver finds its node by this address, never by 127.0.0.1
    ray_port, metrics_port, prom_port = free_port(node_ip), free_port(node_ip), free_port(IP)
    env = clean_env({})
    # Short: Ray's Unix sockets live under it, and pytest's temporary paths run past their 107 characters.
    ray_dir = tempfile.mkdtemp(prefix="raydp-prom-")
    try:
        procs.start(
            [
                RAY,
                "start",
                "--head",
                "--block",
                f"--node-ip-address={node_ip}",
                f"--port={ray_port}",
                f"--metrics-export-port={metrics_port}",
                f"--ray-client-server-port={free_port(node_ip)}",
                f"--dashboard-agent-listen-port={free_port(node_ip)}",
                "--include-dashboard=false",
                "--num-cpus=6",
                "--num-gpus=2",
                "--disable-usage-stats",
                f"--temp-dir={ray_dir}",
            ],
            "head.log",
            env,
        )
        # `ray start --block` says so once the node is up; a driver that comes sooner finds no node to join.
        assert wait_until(lambda: "Ray runtime started" in procs.log_tail("head.log", 100_000), timeout=90), (
            procs.log_tail("head.log")
        )
        with raydp_serve(
            "--backend",
            "ray",
            "--address",
            f"{node_ip}:{ray_port}",
            "--name",
            NAME,
            "--engine",
            "tiny-lm",
            "--dp-size",
            "2",
            "--api-servers",
            "2",
            "--autoscale",  # a size the load never moves, so that the autoscaler's gauges exist
            "2:2",
            env={
                **{k: env[k] for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")},
                # Engines that report a prefix cache (blocks of 2 tokens: the load's prompts fill some) and
                # adapter slots, so that the hit-rate and adapter panels have data.
                "RAYDP_ENGINE_KWARGS": json.dumps({"prefix_cache_blocks": 64, "block_size": 2, "max_loras": 2}),
            },
        ) as served:
            config = workdir / "prometheus.yml"
            config.write_text(
                json.dumps(
                    {
                        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                        "scrape_configs": [
                            {"job_name": "raydp-api", "static_configs": [{"targets": [f"{IP}:{served.address[1]}"]}]},
                            {"job_name": "ray", "static_configs": [{"targets": [f"{node_ip}:{metrics_port}"]}]},
                        ],
                    }
                )
            )  # JSON is YAML
            procs.start(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address={IP}:{prom_port}",
                ],
                "prometheus.log",
                env,
            )
            send_adapter_requests(f"{node_ip}:{ray_port}", env)
            yield served, f"http://{IP}:{prom_port}"
    finally:
        procs.stop()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert procs.alive() == []


ADAPTER_LOAD = f"""
import raydp
client = raydp.attach({NAME!r}).client()
for i in range(12):  # three adapters over two slots on each rank: loads, hits and evictions
    assert len(client.generate([1, 2, 3], 2, adapter=f"ad{{i % 3}}", timeout=60)) == 2
"""


def send_adapter_requests(address: str, env: dict[str, str]) -> None:
    """Requests for LoRA adapters through raydp's Python client (the reference engines' slots hold names)."""
    run_env = {**env, "RAY_ADDRESS": address, "PYTHONPATH": os.getcwd(), "RAYDP_LOG_LEVEL": "WARNING"}
    done = subprocess.run(
        [sys.executable, "-c", ADAPTER_LOAD], env=run_env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


def load(served: Served, stop: threading.Event, failures: list[BaseException]) -> None:
    """Streams, whole answers and a few refused requests (400s), bounded in count."""
    sdk = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=30)
    try:
        for i in range(3000):
            if stop.is_set():
                return
            if i % 10 == 9:
                try:
                    sdk.completions.create(model=NAME, prompt=[1], max_tokens=0)
                except openai.BadRequestError:
                    continue
                raise AssertionError("max_tokens=0 was served")
            if i % 2:
                list(sdk.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=8, stream=True))
            else:
                sdk.completions.create(model=NAME, prompt=[4, 5], max_tokens=4)
    except BaseException as exc:
        failures.append(exc)


def query(prometheus: str, expr: str) -> list[Any]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def concrete(expr: str) -> str:
    """A dashboard query as Grafana would send it for this cluster."""
    return expr.replace("$__rate_interval", "1m").replace("$cluster", NAME)


def test_every_dashboard_query_returns_data_and_every_metric_is_charted_or_left_out(stack: tuple[Served, str]) -> None:
    served, prometheus = stack
    stop = threading.Event()
    failures: list[BaseException] = []
    loader = threading.Thread(target=load, args=(served, stop, failures), daemon=True)
    loader.start()
    try:
        empty = list(queries())
        deadline = time.monotonic() + 120
        while empty and time.monotonic() < deadline:
            time.sleep(2)
            try:
                empty = [expr for expr in empty if not query(prometheus, concrete(expr))]
            except OSError:
                continue  # Prometheus still starting
        assert empty == [], f"queries without data: {empty}"
        names = query(prometheus, 'group by (__name__) ({__name__=~"(ray_)?raydp_.*"})')
    finally:
        stop.set()
        loader.join(timeout=60)
    assert failures == []
    exported = {n["metric"]["__name__"] for n in names}
    families = {_family(name) for name in exported}
    unaccounted = sorted(f for f in families if f not in LEFT_OUT and not _charted(f))
    assert unaccounted == [], f"exported but neither charted nor listed in raydp.dashboard.LEFT_OUT: {unaccounted}"
    assert {"raydp_http_requests_total", "ray_raydp_rank_waiting"} <= exported


def _charted(family: str) -> bool:
    """A query reads the family itself (not merely a longer name that ends with it, as ray_ + it does)."""
    return any(re.search(rf"(?<![\w]){family}(_total|_bucket|_sum|_count)?\b", q) for q in queries())


def _family(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count", "_created", "_total"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
