"""P/D pools against collocated DP=2 on the same two cores: ``python -m benchmarks.vllm_dp.pd [--quick]``.

Two ``raydp serve --engine vllm`` servers take turns on the bench's small
Llama (:mod:`.run`'s ``tiny`` size, max-model-len 2048): collocated ``--dp-size
2``, and ``--prefill-dp-size 1 --decode-dp-size 1`` with vLLM's
``ExampleConnector`` over a temporary directory. Each turn runs two ``vllm
bench serve`` loads at once against the server, the workload the issue names:
long prompts (``--long-len`` tokens, a few tokens out, one at a time) and
short chats (``--short-len`` tokens in, ``--short-out`` out, ``--short-concurrency``
at a time). The figures: the short streams' ITL p99 and TTFT p50/p99 (what a
long prefill stalls on a collocated rank), the long prompts' TTFT p50/p99,
and the output throughput of both loads together.

What this machine cannot show: the connector writes and reads the KV through
files on a 2-core VM shared by both ranks, not over a GPU fabric; the prefill
and decode ranks compete for the same cores, so P/D's isolation is bounded by
the OS scheduler, not by separate devices.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import log
from benchmarks.vllm_dp.bench_serve import bench_serve, dataset_args
from benchmarks.vllm_dp.load import wait_ready
from benchmarks.vllm_dp.run import build_model
from benchmarks.vllm_dp.servers import spawn

SYSTEMS = ("collocated", "pd")


@dataclass
class Loads:
    long_len: int = 1500
    long_out: int = 8
    long_requests: int = 12
    short_len: int = 64
    short_out: int = 64
    short_requests: int = 64
    short_concurrency: int = 4
    seed: int = 0


@dataclass
class PdTurn:
    system: str
    turn: int
    short_itl_p99_ms: float = 0.0
    short_ttft_p50_ms: float = 0.0
    short_ttft_p99_ms: float = 0.0
    long_ttft_p50_ms: float = 0.0
    long_ttft_p99_ms: float = 0.0
    tok_s: float = 0.0
    failed: int = 0
    startup_s: float = 0.0
    error: str | None = None


def engine_flags(loads: Loads) -> list[str]:
    max_len = max(2048, loads.long_len + loads.long_out + 16)
    return ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_len), "--max-num-seqs", "32"]


def system_flags(system: str, store: Path) -> list[str]:
    if system == "collocated":
        return []
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return ["--prefill-dp-size", "1", "--decode-dp-size", "1", "--kv-transfer-config", json.dumps(kv)]


def run_loads(url: str, model: str, loads: Loads, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The long and the short load at once; each ``vllm bench serve``'s result."""
    long_args = dataset_args("random", loads.long_len, loads.long_out, 0, 0)
    short_args = dataset_args("random", loads.short_len, loads.short_out, 0, 0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(bench_serve, url, model, long_args, loads.long_requests, 1, loads.seed, timeout_s)
        short = pool.submit(
            bench_serve,
            url,
            model,
            short_args,
            loads.short_requests,
            loads.short_concurrency,
            loads.seed + 1,
            timeout_s,
        )
        return long.result(), short.result()


def one_turn(system: str, turn: int, model: str, loads: Loads, log_dir: Path, timeout_s: float) -> PdTurn:
    result = PdTurn(system, turn)
    with tempfile.TemporaryDirectory(prefix="pd-kv-") as store:
        server = spawn(
            "raydp", model, [*engine_flags(loads), *system_flags(system, Path(store))], log_dir, f"{system}{turn}"
        )
        try:
            result.startup_s = asyncio.run(wait_ready(server, timeout_s))
            bench_serve(
                server.url, model, dataset_args("random", 64, 8, 0, 0), 4, 2, loads.seed + 7, timeout_s
            )  # warm-up
            long, short = run_loads(server.url, model, loads, timeout_s)
            result.short_itl_p99_ms, result.short_ttft_p50_ms = short["p99_itl_ms"], short["median_ttft_ms"]
            result.short_ttft_p99_ms = short["p99_ttft_ms"]
            result.long_ttft_p50_ms, result.long_ttft_p99_ms = long["median_ttft_ms"], long["p99_ttft_ms"]
            result.tok_s = float(long["output_throughput"]) + float(short["output_throughput"])
            result.failed = int(long.get("failed", 0)) + int(short.get("failed", 0))
            log(f"{system} turn {turn}: short ITL p99 {result.short_itl_p99_ms:.1f} ms, {result.tok_s:.0f} tok/s")
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:600]
            log(f"{system} turn {turn} failed: {result.error}")
        finally:
            leftover = server.stop()
            if leftover:
                result.error = (result.error or "") + f" leftover processes: {leftover}"
    return result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


FIELDS = ("short_itl_p99_ms", "short_ttft_p50_ms", "short_ttft_p99_ms", "long_ttft_p50_ms", "long_ttft_p99_ms", "tok_s")


def table(turns: list[PdTurn]) -> str:
    rows = [
        "| system | short ITL p99 ms | short TTFT p50 ms | short TTFT p99 ms | long TTFT p50 ms | long TTFT p99 ms "
        "| output tok/s | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    medians: dict[str, dict[str, float]] = {}
    for system in SYSTEMS:
        ok = [t for t in turns if t.system == system and t.error is None]
        medians[system] = {f: median([getattr(t, f) for t in ok]) for f in FIELDS}
        m = medians[system]
        cells = " | ".join(f"{m[f]:,.1f}" for f in FIELDS)
        rows.append(f"| {system} | {cells} | {sum(t.failed for t in ok)} |")
    base, pd = medians["collocated"], medians["pd"]
    ratios = ", ".join(f"{f} {pd[f] / base[f]:.2f}x" for f in FIELDS if base[f])
    return "\n".join(rows) + f"\n\nP/D over collocated: {ratios}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_dp.pd", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one turn each, fewer requests")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the turns as JSON here")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    loads = Loads(long_requests=6, short_requests=32) if args.quick else Loads()
    turns_each = 1 if args.quick else args.turns
    model = build_model(None, "tiny")
    turns: list[PdTurn] = []
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as logs:
        for turn in range(turns_each):
            for system in SYSTEMS:  # alternating: the machine's drift falls on both
                turns.append(one_turn(system, turn, model, loads, Path(logs), args.timeout_s))
    print(table(turns))
    if args.json:
        Path(args.json).write_text(json.dumps({"loads": asdict(loads), "turns": [asdict(t) for t in turns]}, indent=2))
    return 1 if any(t.error for t in turns) else 0


if __name__ == "__main__":
    sys.exit(main())
