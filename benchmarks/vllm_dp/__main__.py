"""``python -m benchmarks.vllm_dp``: the vLLM benchmark on its own (see :mod:`benchmarks.vllm_dp`)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from benchmarks import vllm_dp
from benchmarks.vllm_dp.bench import run_benchmark
from benchmarks.vllm_dp.run import (
    DATASETS,
    FULL,
    QUICK,
    SIZES,
    SYSTEMS,
    Options,
    Workload,
    vllm_failed,
)
from benchmarks.vllm_dp.table import vllm_table


def options_from(args: argparse.Namespace) -> Options:
    base = QUICK if args.quick else FULL
    w = base.workload
    workload = Workload(
        requests=args.requests or w.requests,
        concurrency=args.concurrency or w.concurrency,
        prompt_len=args.prompt_len or w.prompt_len,
        max_tokens=args.max_tokens or w.max_tokens,
        seed=args.seed,
    )
    return Options(
        workload,
        turns=base.turns if args.turns is None else args.turns,
        faults=not args.no_faults,
        hangs=not args.no_hangs,
        model_dir=args.model_dir,
        systems=tuple(args.system or SYSTEMS),
        fault_window_s=args.fault_window,
        omp_threads=args.omp_threads,
        size=args.size,
        datasets=tuple(args.dataset or DATASETS),
    )


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the finally blocks stop the servers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(vllm_dp.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 requests, 1 turn per system")
    parser.add_argument("--requests", type=int, help="measured requests per turn (default 256)")
    parser.add_argument("--concurrency", type=int, help="requests in flight (default 16)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default 128)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (default 64)")
    parser.add_argument(
        "--turns", type=int, help="measured turns per system (default 2; 1 with --quick; 0: the fault turns only)"
    )
    parser.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of every engine (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", help="checkpoint directory (default: build the small model into the cache)")
    parser.add_argument("--no-faults", action="store_true", help="leave out the kill turns")
    parser.add_argument("--no-hangs", action="store_true", help="leave out the hang turns")
    parser.add_argument("--fault-window", type=float, default=90.0, help="seconds to watch after the kill")
    parser.add_argument("--system", action="append", choices=SYSTEMS, help="run only this system (repeatable)")
    parser.add_argument("--dataset", action="append", choices=DATASETS, help="run only this workload (repeatable)")
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="tiny", help="tiny (default): the plumbing shows; compute: ~170 M"
    )
    parser.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    report = run_benchmark(options_from(args))
    print("\n".join(vllm_table(report)))
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=1) + "\n")
    return 1 if vllm_failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
