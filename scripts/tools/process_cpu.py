"""Where a run's CPU goes, by kind of process: a sampler of /proc, and its report.

    python scripts/tools/process_cpu.py sample run.json &   # every 2 s, until SIGTERM or SIGINT
    bash .ci/run; kill %1
    python scripts/tools/process_cpu.py report run.json     # CPU-seconds per kind, most first

The suite is CPU-bound on 2 cores, so its wall time is the CPU its processes
use: this says which processes those are (vLLM engines, Ray's daemons, idle
workers, the machine's own kernel threads) where ``--durations`` only says
which tests wait. Linux only; stdlib only, so it runs beside any venv. A
process that lives under one sampling period is missed, so short processes are
undercounted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

PERIOD_S = 2.0
MAPS_AFTER_S = 4.0  # what a process has loaded is read once it is past its imports
LIBRARIES = ("vllm", "torch", "_raylet")
TICKS = os.sysconf("SC_CLK_TCK")

# (kind, pattern on the command line or the latest process title), the first that matches wins.
KINDS: tuple[tuple[str, str], ...] = (
    ("ray: raylet", r"/raylet/raylet "),
    ("ray: gcs_server", r"/gcs/gcs_server "),
    ("ray: dashboard agent", r"dashboard/agent\.py|ray::DashboardAgent"),
    ("ray: runtime env agent", r"runtime_env/agent|ray::RuntimeEnvAgent"),
    ("ray: dashboard", r"dashboard/dashboard\.py"),
    ("ray: log monitor", r"log_monitor\.py"),
    ("ray: autoscaler monitor", r"autoscaler/_private/monitor\.py"),
    ("ray: client server", r"ray\.util\.client\.server"),
    ("raydp: rank or worker", r"raydp::"),
    ("ray: actor or task", r"ray::(?!IDLE)"),
    ("ray: worker that ran nothing seen", r"default_worker\.py|ray::IDLE"),
    ("pytest", r"pytest|xdist"),
    ("raydp CLI", r"-m raydp |bin/raydp "),
    ("spawned child", r"multiprocessing\.spawn"),
    ("fork server or a child it forked", r"multiprocessing\.forkserver"),
    ("compiler", r"cc1plus|g\+\+"),
    ("python, other", r"python"),
)


def sample(out: Path) -> None:
    """Every PERIOD_S until SIGTERM or SIGINT: each process's CPU time, command line, titles and libraries."""
    seen: dict[str, dict[str, Any]] = {}
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    print(f"sampling every {PERIOD_S:g} s; SIGTERM or Ctrl-C writes {out}", flush=True)
    before = True  # the first pass: what runs already is counted from here, not from its start
    while True:  # one pass at least, however soon the stop comes
        now = time.time()
        for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
            try:
                _observe(seen, pid, now, before)
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
        before = False
        if stopping:
            break
        time.sleep(PERIOD_S)
    out.write_text(json.dumps(list(seen.values())))


def _observe(seen: dict[str, dict[str, Any]], pid: int, now: float, before: bool) -> None:
    stat = Path(f"/proc/{pid}/stat").read_text()
    comm, rest = stat.split("(", 1)[1].rsplit(")", 1)
    fields = rest.split()
    key = f"{pid}-{fields[19]}"  # the start time tells a reused pid apart
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    record = seen.setdefault(key, {"pid": pid, "ppid": int(fields[1]), "comm": comm, "first": now, "titles": []})
    cpu_s = (int(fields[11]) + int(fields[12])) / TICKS
    record.setdefault("cpu_before_s", cpu_s if before else 0.0)
    record["cpu_s"] = cpu_s - record["cpu_before_s"]  # a kernel thread's CPU since boot is not the run's
    if cmdline and (not record["titles"] or record["titles"][-1] != cmdline[:200]):
        record["titles"] = [*record["titles"][-2:], cmdline[:200]]  # Ray and raydp retitle their processes
    if "libraries" not in record and now - record["first"] >= MAPS_AFTER_S:
        maps = Path(f"/proc/{pid}/maps").read_text()
        record["libraries"] = [lib for lib in LIBRARIES if lib in maps]


def kind_of(record: dict[str, Any]) -> str:
    text = " ".join(record.get("titles", [])) or record.get("comm", "")
    for kind, pattern in KINDS:
        if re.search(pattern, text):
            libraries = record.get("libraries") or []
            loaded = "vllm" if "vllm" in libraries else "torch" if "torch" in libraries else ""
            return f"{kind} ({loaded})" if loaded and kind.startswith(("raydp", "spawned", "fork", "python")) else kind
    return f"kernel or other: {record.get('comm', '?')}" if not record.get("titles") else "other"


def report(records: list[dict[str, Any]]) -> list[tuple[str, int, float]]:
    """(kind, processes, CPU-seconds), the most CPU first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for record in records:
        total = totals[kind_of(record)]
        total[0] += 1
        total[1] += record.get("cpu_s", 0.0)
    rows = [(kind, int(n), round(cpu, 1)) for kind, (n, cpu) in totals.items()]
    return sorted(rows, key=lambda row: -row[2])


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("sample", "report"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "sample":
        sample(Path(argv[1]))
        return 0
    rows = report(json.loads(Path(argv[1]).read_text()))
    everything = sum(cpu for _, _, cpu in rows)
    print(f"{everything:8.0f} CPU-s in all")
    for kind, n, cpu in rows:
        if cpu >= 1:
            print(f"{cpu:8.0f} CPU-s {100 * cpu / everything:5.1f}% {n:6d} processes  {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
