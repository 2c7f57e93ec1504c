"""Autoscaling on Ray's fake multi-node autoscaler: raydp asks for ranks, Ray adds nodes, and both shrink back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from raydp.testing import fake_autoscaler
from raydp.testing.ray_hosts import wait_for_head


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_load_step_adds_ranks_on_new_nodes_and_they_go_when_it_falls() -> None:
    with tempfile.TemporaryDirectory(prefix="rdpfa-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        procs, address = fake_autoscaler.start(workdir, worker_gpus=1, min_workers=1, max_workers=3)
        try:
            wait_for_head(address)
            out = subprocess.run(
                [sys.executable, "-m", "tests.integration.autoscale_driver", address],
                env={**os.environ, "PYTHONPATH": os.getcwd(), "RAY_AUTH_MODE": "disabled"},
                capture_output=True,
                text=True,
                timeout=800,
                check=False,
            )
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            assert out.returncode == 0 and lines, out.stderr[-4000:] + procs.log_tail("head.log")
            seen = json.loads(lines[-1].removeprefix("RESULT "))
        finally:
            left = fake_autoscaler.stop(procs)
        assert left == [], "the fake cluster's processes are gone"
    print(f"\nautoscaler on the fake multi-node Ray: {seen}")
    assert len(seen["nodes_at_start"]) == 1
    assert seen["grew"], seen
    # Ray added a node for each new rank (one GPU each), and the new ranks landed on them.
    assert len(seen["nodes_at_peak"]) == 3, seen
    new_nodes = set(seen["nodes_at_peak"]) - set(seen["nodes_at_start"])
    assert set(seen["rank_nodes_at_peak"][1:]) == new_nodes, seen
    # The load fell: raydp drained back to the minimum, and Ray removed the idle nodes.
    assert seen["shrank"] and seen["nodes_removed"], seen
    assert seen["answer_at_end"] == [4, 4]
    assert set(seen["outcomes"]) == {"ok"}, seen["outcomes"]
    assert seen["actors_left"] == [] and seen["groups_left"] == [], seen
