"""The whole vLLM benchmark: the measured turns of every system, then the fault and hang turns.

Apart from :mod:`benchmarks.vllm_dp.run` (one turn) and :mod:`benchmarks.vllm_dp.faults`
(the fault turns, which build on it), so that neither imports the other's caller.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks.vllm_dp.faults import fault_turn, hang_turn
from benchmarks.vllm_dp.load import make_prompts
from benchmarks.vllm_dp.run import (
    FULL,
    QUICK,
    Options,
    Setup,
    VllmReport,
    build_model,
    engine_flags,
    measure,
)


def run_benchmark(opts: Options) -> VllmReport:
    from raydp.models.checkpoint import parameter_count

    model = build_model(opts.model_dir, opts.size)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    w = opts.workload
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    setup = Setup(opts, model, vocab, engine_flags(w), log_dir, make_prompts(w.requests, w.prompt_len, vocab, w.seed))
    report = VllmReport(asdict(w), model_dir=model, log_dir=str(log_dir), engine_flags=setup.flags, size=opts.size)
    report.fault_window_s = opts.fault_window_s
    report.parameters = parameter_count(model)
    for dataset in opts.datasets:
        for turn in range(opts.turns):
            for system in opts.systems:  # alternating: a slow minute of the machine hits every system
                report.turns.append(measure(setup, system, turn, dataset))
    # The systems that served: a fault turn of one that cannot start says nothing new (with --turns 0, all).
    served = [s for s in opts.systems if not report.turns or any(t.system == s and not t.error for t in report.turns)]
    if opts.faults:
        for system in served:
            report.faults.append(fault_turn(setup, system))
    if opts.hangs:
        for system in served:
            report.faults.append(hang_turn(setup, system))
    return report


def vllm_benchmark(quick: bool) -> VllmReport:
    """The ``vllm`` section's entry point."""
    return run_benchmark(QUICK if quick else FULL)


__all__ = ["run_benchmark", "vllm_benchmark"]
