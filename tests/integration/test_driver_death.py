"""The driver's death (its process, or its node) ends a cluster it launched, and nothing is left.

Stated behaviour: the engine and coordinator actors of a non-detached cluster
are owned by the driver, so Ray ends them with it (owner died) and removes its
placement groups; the socket directories their SIGKILLed processes could not
remove are swept by the next raydp process on the node. A detached cluster
outlives its driver (``test_attach.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from raydp.wire.transport import sweep_stale_ipc_dirs
from tests.integration.helpers import live_actors, live_groups, socket_dirs, wait_until

DRIVER = textwrap.dedent("""
    import sys, time
    import ray, raydp
    ray.init(address=sys.argv[1], log_to_driver=False)
    cluster = raydp.launch(name="orphan", dp_size=2, progress=False)
    assert cluster.client().generate([3], max_tokens=2, timeout=60) == [3, 3]
    print("serving", flush=True)
    time.sleep(600)
""")


def swept() -> bool:
    sweep_stale_ipc_dirs()
    return not socket_dirs("orphan")


@pytest.mark.timeout(180)
def test_a_killed_driver_takes_its_cluster_with_it(two_nodes: Any) -> None:
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, two_nodes.address],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "serving"
        assert len(live_actors("orphan")) == 3 and len(live_groups("orphan")) == 2
        assert socket_dirs("orphan"), "the cluster's engines and coordinator bound IPC sockets"
        os.kill(driver.pid, signal.SIGKILL)  # as if its node died: no close(), no atexit
        driver.wait(10)
        assert wait_until(lambda: not live_actors("orphan"), timeout=60), live_actors("orphan")
        assert wait_until(lambda: not live_groups("orphan"), timeout=60), live_groups("orphan")
        # What any raydp process on the node does when it makes its own (the killed
        # processes may take a moment to be reaped after Ray reports them dead).
        assert wait_until(swept, timeout=30), socket_dirs("orphan")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
