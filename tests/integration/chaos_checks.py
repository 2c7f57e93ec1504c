"""Checks shared by the chaos soaks' tests: what a soak's JSON summary must show about its requests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BRISK = ["--warmup-s", "5", "--gap-s", "0.2", "1"]  # short pauses: the faults, not the waits, are the test


def run_soak(
    args: list[str], kinds: set[str], timeout_s: float, after: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """Run ``python -m raydp.testing.chaos ARGS --json`` in its own Ray (never an ambient one) and check what
    every soak must show: a summary, no violation, exit code 0, each of ``kinds`` hit, each fault detected and
    recovered from. Past ``timeout_s`` it gets a SIGTERM, on which it tears down what it started; ``after``
    runs once it has ended, however it ended. Returns the summary."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "raydp.testing.chaos", *args, "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        after()
    tail = err[-6000:]
    # The summary is the last JSON line: a Ray process's crash report may land on stdout after it.
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no summary (exit code {proc.returncode}):\n{out[-3000:]}\n{tail}"
    summary: dict[str, Any] = json.loads(lines[-1])
    assert summary["violations"] == [], f"{summary['violations']}\n{tail}"
    assert proc.returncode == 0, tail
    assert set(summary["faults_by_kind"]) == kinds, summary["faults_by_kind"]
    assert all(f["detect_s"] is not None and f["back_s"] is not None for f in summary["faults"])
    return summary


def assert_requests_accounted(summary: dict[str, Any], least_ok: int = 100) -> None:
    """Every driver and HTTP request ended in a known outcome, the load kept flowing, none lost or hung."""
    requests = summary["requests"]
    outcomes = requests["outcomes"]
    assert set(outcomes) == {"driver", "http"}
    for source, counts in outcomes.items():
        assert sum(counts.values()) == requests["submitted"][source], f"{source}: every request accounted for"
        assert counts["ok"] > least_ok, f"{source}: the load kept flowing"
        assert counts["wrong"] == counts["duplicate"] == counts["hung"] == counts["untyped"] == 0, counts
    assert requests["lost"] == 0 and requests["stuck_threads"] == 0
    migrated = requests["migrated"]  # streams that moved on a rank's death, each checked whole and in order
    assert set(migrated) == {"driver", "http"}
    assert all(m["moves"] >= m["streams"] >= 0 for m in migrated.values()), migrated
