"""A startup that wedges: raydp's ``serve`` against vLLM's own DP server when one engine's model load never ends.

Run as ``.venv/bin/python -m benchmarks.vllm_dp.wedge [--bound-s S] [--startup-timeout-s S] [--json PATH]``.

Both systems start DP=2 on the small model with the same engine flags as
:mod:`benchmarks.vllm_dp`, with ``hang_hook`` armed by ``RAYDP_BENCH_WEDGE``:
the first vLLM worker to load its model blocks there for good (once: its
marker file says so), as the startups of vllm#53157 did. Each system is then
watched for ``--bound-s`` seconds (default 150): when the wedge began (the
marker's time), when the system said so (raydp: its ``the start failed`` line),
its first answered completion, or its exit. Startup times are from the spawn.
vLLM's own startup wait (``wait_for_engine_startup``) has no deadline, so
without an answer or an exit its row says it was still waiting at the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from benchmarks.common import log
from benchmarks.vllm_dp.faults import HANG_HOOK
from benchmarks.vllm_dp.load import last_error, probe
from benchmarks.vllm_dp.run import Workload, build_model, engine_flags
from benchmarks.vllm_dp.servers import REPO, Server, spawn

SYSTEMS = ("raydp", "vllm")
RETRY_LINE = "the start failed"  # raydp serve's line when it starts again


@dataclass
class WedgeRow:
    system: str
    wedged_s: float | None = None  # spawn to the wedge (the marker's creation)
    detected_s: float | None = None  # spawn to the system saying so
    served_s: float | None = None  # spawn to the first answered completion
    exited_s: float | None = None
    exit_code: int | None = None
    said: str = ""  # what the system said of it, if anything
    leftover: list[str] | None = None


def measure(system: str, model: str, flags: list[str], log_dir: Path, bound_s: float) -> WedgeRow:
    marker = log_dir / f"{system}.wedged"
    env = {"PYTHONPATH": f"{HANG_HOOK}:{REPO}", "RAYDP_BENCH_WEDGE": str(marker)}
    server = spawn(system, model, flags, log_dir, "wedge", extra_env=env)
    row = WedgeRow(system)
    try:
        asyncio.run(watch(server, marker, row, bound_s))
    finally:
        row.leftover = server.stop()
    return row


async def watch(server: Server, marker: Path, row: WedgeRow, bound_s: float) -> None:
    async with aiohttp.ClientSession() as session:
        while (now := time.monotonic()) - server.spawned < bound_s:
            if row.wedged_s is None and marker.exists():
                row.wedged_s = marker.stat().st_mtime - (time.time() - now) - server.spawned
            text = server.log_tail(200_000)
            if row.detected_s is None and RETRY_LINE in text:
                row.detected_s = now - server.spawned
                row.said = next(line for line in text.splitlines() if RETRY_LINE in line)[:300]
            if server.proc.poll() is not None:
                row.exited_s, row.exit_code = now - server.spawned, server.proc.returncode
                row.said = row.said or last_error(text)
                return
            if await probe(session, server):
                row.served_s = time.monotonic() - server.spawned
                log(f"{server.system}: serving after {row.served_s:.1f} s")
                return
            await asyncio.sleep(0.5)


def table(rows: list[WedgeRow], bound_s: float) -> list[str]:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} s"

    lines = [
        "| system | wedged at | said so at | first answer at | exited | what it said |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        answer = s(r.served_s) if r.served_s is not None else f"none within {bound_s:g} s"
        exited = "no" if r.exited_s is None else f"at {r.exited_s:.1f} s (code {r.exit_code})"
        lines.append(f"| {r.system} | {s(r.wedged_s)} | {s(r.detected_s)} | {answer} | {exited} | {r.said} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--bound-s", type=float, default=150.0, help="how long to watch each system")
    parser.add_argument("--startup-timeout-s", type=float, default=30.0, help="raydp's startup_timeout_s")
    parser.add_argument("--system", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    model = build_model(None, "tiny")
    flags = engine_flags(Workload())
    rows: list[WedgeRow] = []
    with tempfile.TemporaryDirectory(prefix="raydp-wedge-") as logs:
        for system in args.system:
            extra = ["--startup-timeout-s", str(args.startup_timeout_s)] if system == "raydp" else []
            rows.append(measure(system, model, [*flags, *extra], Path(logs), args.bound_s))
            log(f"{system}: {asdict(rows[-1])}")
    print("\n".join(table(rows, args.bound_s)))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 1 if any(r.leftover for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
