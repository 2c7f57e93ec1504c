"""A detached cluster outlives its launcher; a notebook attaches to it by name."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from typing import Any

import pytest
import ray

import raydp
from tests.integration.helpers import assert_nothing_left, live_actors

LAUNCHER = """
import ray, raydp
ray.init(address="{address}")
cluster = raydp.launch(name="nb", dp_size=2, detached=True, progress=False)
print("launched", cluster.dp_size, flush=True)
"""


@pytest.mark.timeout(180)
def test_attach_to_a_detached_cluster_then_shut_it_down(two_nodes: Any) -> None:
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHER.format(address=address)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and "launched 2" in out.stdout, out.stderr[-3000:]
    # The launcher has exited; the cluster is still there.
    assert sorted(live_actors("nb")) == ["nb-coordinator", "nb-dp0", "nb-dp1", "nb-supervisor"]
    # The handle is dropped at once; the client it made must not be closed under the caller.
    client = raydp.attach("nb").client()
    gc.collect()
    assert client.generate([7], max_tokens=2, timeout=30) == [7, 7]
    client.close()
    cluster = raydp.attach("nb")
    try:
        assert cluster.dp_size == 2
        client = cluster.client()
        handles = [client.submit([i], max_tokens=2) for i in range(10)]
        assert [h.result(timeout=30) for h in handles] == [[i, i] for i in range(10)]
        cluster.close()
        running = ["nb-coordinator", "nb-dp0", "nb-dp1", "nb-supervisor"]
        assert sorted(live_actors("nb")) == running, "close() only detaches"
    finally:
        raydp.attach("nb").shutdown()
    assert_nothing_left("nb", timeout=30)
    with pytest.raises(raydp.ConfigError, match="name='nb'"):
        raydp.attach("nb")
