"""Adapter-aware routing on real vLLM engines, driven by ``vllm bench serve``'s own LoRA options.

Run as ``.venv/bin/python -m benchmarks.vllm_dp.loras [--requests N] [--rate R] [--json PATH]``.

``raydp serve --engine vllm --dp-size 2`` on the small model with 8 LoRA
adapters (``make_lora_adapter``: rank 8 on ``q_proj``/``v_proj``) given by
``--lora-modules`` and ``--max-loras 2`` per rank, so the ranks hold 4 of the
8 at once and every other request for a cold adapter evicts one. The load is
``vllm bench serve`` unchanged: random 128-token prompts, 32 tokens out,
Poisson arrivals at ``--rate``; its ``--lora-modules`` picks each request's
adapter uniformly from the list given, so the list repeats each adapter by
its Zipf weight (exponent 1.1): a skewed popularity. Each policy is a fresh
server with the same requests (the same seed):

* ``adapter-aware``: raydp's default (an adapter's requests go to the ranks
  that hold it, within a load margin; else a free slot; else the rank whose
  coldest adapter is asked for least);
* ``least-loaded``: ``--no-adapter-affinity``;
* ``round-robin``: ``--balancer round-robin``.

Reported: adapter loads on the ranks (swaps: ``raydp_rank_adapter_loads`` on
``/metrics``, summed), TTFT p50 and p99, and output tokens/s, as ``vllm bench
serve`` measured them; ratios over least-loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import log
from benchmarks.vllm_dp.bench_serve import bench_serve, dataset_args
from benchmarks.vllm_dp.load import wait_ready
from benchmarks.vllm_dp.run import Workload, build_model, engine_flags
from benchmarks.vllm_dp.servers import spawn
from raydp.models.checkpoint import make_lora_adapter

POLICIES = {
    "adapter-aware": [],
    "least-loaded": ["--no-adapter-affinity"],
    "round-robin": ["--balancer", "round-robin"],
}
ADAPTERS, SLOTS, ZIPF, PICKS = 8, 2, 1.1, 50  # PICKS: the length of the list vllm bench serve draws from
TARGETS = {"loads": 0.3, "ttft_p50": 0.8, "throughput": 1.0}  # adapter-aware over least-loaded
PROMPT_LEN, MAX_TOKENS = 128, 32
LOADS = re.compile(r"^raydp_rank_adapter_loads\{[^}]*\} ([0-9.e+]+)$", re.M)


@dataclass
class LoraRow:
    policy: str
    requests: int = 0
    failed: int = 0
    loads: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    tok_s: float = 0.0
    error: str = ""


def zipf_picks(names: list[str]) -> list[str]:
    """``names`` repeated by Zipf weight (the most popular first), ``PICKS`` entries in all."""
    weights = [1 / (i + 1) ** ZIPF for i in range(len(names))]
    counts = [max(1, round(PICKS * w / sum(weights))) for w in weights]
    return [name for name, count in zip(names, counts, strict=True) for _ in range(count)]


def adapters(model: str) -> dict[str, str]:
    base = Path(model)
    return {
        f"ad{i}": str(make_lora_adapter(base, base.parent / f"{base.name}-lora-ad{i}", seed=i))
        for i in range(1, ADAPTERS + 1)
    }


def measure(policy: str, model: str, loras: dict[str, str], args: argparse.Namespace, logs: Path) -> LoraRow:
    lora_flags = ["--enable-lora", "--max-loras", str(SLOTS), "--max-lora-rank", "8", "--max-cpu-loras", str(SLOTS)]
    modules = ["--lora-modules", *(f"{name}={path}" for name, path in loras.items())]
    flags = [*engine_flags(Workload()), *lora_flags, *modules, *POLICIES[policy]]
    server = spawn("raydp", model, flags, logs, policy)
    row = LoraRow(policy)
    try:
        asyncio.run(wait_ready(server, 300))
        load = [
            *dataset_args("random", PROMPT_LEN, MAX_TOKENS, 0, 0),
            *("--request-rate", str(args.rate), "--lora-modules", *zipf_picks(list(loras))),
        ]
        done = bench_serve(server.url, model, load, args.requests, 32, 0, 900)
        row.requests, row.failed = int(done["completed"]) + int(done.get("failed", 0)), int(done.get("failed", 0))
        row.ttft_p50_ms, row.ttft_p99_ms = float(done["median_ttft_ms"]), float(done["p99_ttft_ms"])
        row.tok_s = float(done["output_throughput"])
        row.loads = adapter_loads(server.url)
        log(f"{policy}: {asdict(row)}")
    except Exception as exc:  # a failed policy is reported, not fatal
        row.error = f"{type(exc).__name__}: {exc}"[:400]
        log(f"{policy} failed: {row.error}")
    finally:
        server.stop()
    return row


def adapter_loads(url: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return int(sum(float(value) for value in LOADS.findall(text)))


def table(rows: list[LoraRow]) -> list[str]:
    lines = [
        "| policy | requests | failed | adapter loads | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.policy} | {r.requests} | {r.failed} | {r.loads} | {r.ttft_p50_ms:,.0f} | {r.ttft_p99_ms:,.0f} | "
        f"{r.tok_s:,.0f} |"
        for r in rows
    ]
    by = {r.policy: r for r in rows if not r.error}
    aware, blind = by.get("adapter-aware"), by.get("least-loaded")
    if aware is not None and blind is not None and blind.loads and blind.ttft_p50_ms and blind.tok_s:
        ratios = {
            "loads": aware.loads / blind.loads,
            "ttft_p50": aware.ttft_p50_ms / blind.ttft_p50_ms,
            "throughput": aware.tok_s / blind.tok_s,
        }
        said = ", ".join(
            f"{k} {v:.2f}x ({'met' if (v >= TARGETS[k] if k == 'throughput' else v <= TARGETS[k]) else 'missed'})"
            for k, v in ratios.items()
        )
        lines.append(f"\nadapter-aware over least-loaded: {said}")
    lines += [f"\n{r.policy} failed: {r.error}" for r in rows if r.error]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    parser.add_argument("--policy", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    parser.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    model = build_model(None, "tiny")
    loras = adapters(model)
    with tempfile.TemporaryDirectory(prefix="raydp-loras-") as logs:
        rows = [measure(policy, model, loras, args, Path(logs)) for policy in args.policy]
    print("\n".join(table(rows)))
    if args.json:
        out: list[dict[str, Any]] = [asdict(r) for r in rows]
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 1 if any(r.error or r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
