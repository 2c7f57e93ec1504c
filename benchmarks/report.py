"""What a run records and prints: the environment, each section's tables, and the JSON of every number."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.sections import Section


def environment(quick: bool, sections: list[Section[Any]]) -> dict[str, Any]:
    """The machine, the versions, the commit and the command: what a reader needs to weigh the numbers."""
    from importlib.metadata import version

    import zmq

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "command": shlex.join(sys.orig_argv),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ray": version("ray"),
        "torch": version("torch"),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgspec": version("msgspec"),
        "raydp_commit": commit,
        "quick": quick,
        "sections": [s.name for s in sections],
    }


def failed(sections: list[Section[Any]], results: dict[str, Any]) -> bool:
    return any(s.failed(results[s.name]) for s in sections if s.name in results)


def tables(sections: list[Section[Any]], results: dict[str, Any], quick: bool) -> dict[str, list[str]]:
    """Each section's markdown lines (tables and verdicts), by section name, in run order."""
    return {s.name: s.table(results[s.name], quick) for s in sections if s.name in results}


def as_json(env: dict[str, Any], sections: list[Section[Any]], results: dict[str, Any], quick: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {"environment": env}
    for s in sections:
        if s.name in results:
            payload[s.name.replace("-", "_")] = s.to_json(results[s.name], quick)
    return payload


def print_report(env: dict[str, Any], by_section: dict[str, list[str]]) -> None:
    print()
    print("## raydp benchmark")
    print()
    print(f"command: `{env['command']}`")
    print()
    print(
        f"environment: {env['cpus']} CPUs ({env['cpus_usable']} usable), Python {env['python']}, "
        f"ray {env['ray']}, torch {env['torch']}, pyzmq {env['pyzmq']} (libzmq {env['libzmq']}), "
        f"msgspec {env['msgspec']}, raydp {env['raydp_commit']}, {env['platform']}"
    )
    print("Local Ray: num_cpus=4, num_gpus=4 (logical). Absolute numbers are noise on a shared machine;")
    print("compare the ratios, which come from one run.")
    for lines in by_section.values():
        print()
        print("\n".join(lines))
