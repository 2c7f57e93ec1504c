"""scripts/tools/process_cpu.py: a real sampling of /proc, and the report's kinds."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "process_cpu.py"
spec = importlib.util.spec_from_file_location("process_cpu", SCRIPT)
assert spec is not None and spec.loader is not None
process_cpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(process_cpu)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="samples Linux's /proc"),
]


def test_a_sampling_sees_this_process_and_stops_on_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    sampler = subprocess.Popen([sys.executable, str(SCRIPT), "sample", str(out)], stdout=subprocess.PIPE, text=True)
    assert sampler.stdout is not None and sampler.stdout.readline().startswith("sampling every 2 s")
    sampler.send_signal(signal.SIGTERM)
    assert sampler.wait(timeout=30) == 0
    records = {r["pid"]: r for r in json.loads(out.read_text())}
    me = records[os.getpid()]
    assert me["cpu_before_s"] > 0 and me["cpu_s"] >= 0, "what ran before the sampling is not counted"
    assert process_cpu.kind_of(me) in ("pytest", "python, other"), me
    assert "process_cpu.py sample" in records[sampler.pid]["titles"][-1], "the sampler saw itself"


def test_the_report_sums_each_kind_and_puts_the_most_cpu_first() -> None:
    records = [
        {"titles": ["/venv/lib/ray/core/src/ray/raylet/raylet --node"], "cpu_s": 1.5},
        {"titles": ["/venv/lib/ray/core/src/ray/raylet/raylet --node"], "cpu_s": 2.0},
        {"titles": ["python -c spawn_main", "raydp::parity dp0 lr0 node 1"], "cpu_s": 9.0, "libraries": ["torch"]},
        {"titles": ["ray::IDLE"], "cpu_s": 1.0},
        {"comm": "kdamond.0", "titles": [], "cpu_s": 4.0},
    ]
    assert process_cpu.report(records) == [
        ("raydp: rank or worker (torch)", 1, 9.0),
        ("kernel or other: kdamond.0", 1, 4.0),
        ("ray: raylet", 2, 3.5),
        ("ray: worker that ran nothing seen", 1, 1.0),
    ]
