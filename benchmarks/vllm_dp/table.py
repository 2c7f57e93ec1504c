"""The vLLM benchmark's table: load medians per system, their ratios, stop times and the fault turns."""

from __future__ import annotations

import statistics

from benchmarks.vllm_dp.faults import HANG_AT_CALL
from benchmarks.vllm_dp.run import (
    KILLED_RANK,
    STARTUP_TARGET,
    SYSTEMS,
    THROUGHPUT_TARGET,
    TTFT_TARGET,
    FaultResult,
    TurnResult,
    VllmReport,
)
from benchmarks.vllm_dp.servers import STEP_TIMEOUT_S

METRICS = (
    ("tok_s", "output tok/s"),
    ("ttft_p50_ms", "TTFT p50 (ms)"),
    ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("itl_p50_ms", "ITL p50 (ms)"),
    ("e2e_p50_ms", "E2E p50 (ms)"),
    ("startup_s", "startup (s)"),
)


TARGETS = (
    ("tok_s", "throughput", ">=", THROUGHPUT_TARGET),
    ("ttft_p50_ms", "TTFT p50", "<=", TTFT_TARGET),
    ("ttft_p99_ms", "TTFT p99", "<=", TTFT_TARGET),
    ("startup_s", "startup", "<=", STARTUP_TARGET),
)


LABELS = {
    "raydp": "raydp (vllm engines, DP=2)",
    "vllm": "vLLM --data-parallel-size 2",
    "vllm-ray": "vLLM --data-parallel-size 2 --data-parallel-backend ray",
    "serve-llm": "Ray Serve LLM build_dp_openai_app (DP=2)",
}
DATASET_LABELS = {"random": "random prompts", "prefix": "prefix_repetition (shared prefixes)"}


def medians(turns: list[TurnResult], system: str) -> dict[str, float | None]:
    mine = [t for t in turns if t.system == system and t.error is None]
    out: dict[str, float | None] = {}
    for key, _ in METRICS:
        values = [v for t in mine if (v := getattr(t, key)) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def load_table(report: VllmReport, systems: tuple[str, ...]) -> list[str]:
    lines = [
        "| system | turns | " + " | ".join(label for _, label in METRICS) + " | failed requests |",
        "|---|---:|" + "---:|" * len(METRICS) + "---|",
    ]
    for system in systems:
        turns = [t for t in report.turns if t.system == system]
        m = medians(report.turns, system)
        failed = sum(t.failed for t in turns)
        notes = [note for t in turns if (note := t.error or t.first_error)]
        cells = " | ".join(_fmt(m[key], 2 if key == "startup_s" else 1) for key, _ in METRICS)
        note = f"{failed}" + (f" ({notes[0][:120]})" if notes else "")
        lines.append(f"| {LABELS[system]} | {sum(t.error is None for t in turns)}/{len(turns)} | {cells} | {note} |")
    return lines


def stop_line(report: VllmReport, systems: tuple[str, ...]) -> str:
    parts = []
    for system in systems:
        runs: list[tuple[float | None, bool]] = [(r.stop_s, r.stop_forced) for r in report.turns if r.system == system]
        runs += [(f.stop_s, f.stop_forced) for f in report.faults if f.system == system]
        times = [t for t, _ in runs if t is not None]
        forced = sum(f for _, f in runs)
        median = f"{statistics.median(times):.1f} s" if times else "n/a"
        parts.append(f"{system} {median}" + (f" ({forced} of {len(runs)} needed SIGKILL)" if forced else ""))
    return f"Stop, SIGTERM to exit (median over every start, fault turns too): {'; '.join(parts)}."


def best_other(turns: list[TurnResult], key: str, higher_is_better: bool) -> tuple[str, float] | None:
    """The best figure among the other systems that ran (what raydp's targets are set against)."""
    figures = [
        (system, value)
        for system in SYSTEMS
        if system != "raydp" and (value := medians(turns, system)[key]) is not None
    ]
    if not figures:
        return None
    return max(figures, key=lambda f: f[1]) if higher_is_better else min(figures, key=lambda f: f[1])


def ratio_lines(turns: list[TurnResult]) -> list[str]:
    ours = medians(turns, "raydp")
    lines = []
    for key, name, sense, target in TARGETS:
        best = best_other(turns, key, sense == ">=")
        if best is None:
            continue
        value = _ratio(ours[key], best[1])
        met = value is not None and (value >= target if sense == ">=" else value <= target)
        lines.append(
            f"- {name}: raydp / best other ({best[0]}) = {_times(value)}, target {sense} {target:g}: "
            f"{'met' if met else 'NOT met'}"
        )
    return lines


def fault_table(faults: list[FaultResult]) -> list[str]:
    lines = [
        "| system | killed | in flight at kill: failed | started after: ok / failed | first OK after kill (s) "
        "| new requests failed until (s) | killed rank back (s) | server exited (s) | watch ended "
        "| commonest error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for f in faults:
        if f.error is not None:
            lines.append(f"| {LABELS[f.system]} | failed: {f.error[:200]} | | | | | | | | |")
            continue
        exited = "no" if f.exited_s is None else f"{f.exited_s:.1f} (rc {f.exit_code})"
        back = _fmt(f.rank_back_s) if f.system == "raydp" else "n/a (no restart)"
        error = next(iter(f.errors), "")
        lines.append(
            f"| {LABELS[f.system]} | {f.target} | {f.in_flight_failed}/{f.in_flight} "
            f"| {f.after_ok} / {f.after_failed} | {_fmt(f.first_ok_s)} | {_fmt(f.last_failed_s)} | {back} "
            f"| {exited} | {f.ended} "
            f"| {error.replace('|', '/')} |"
        )
    return lines


def hang_table(hangs: list[FaultResult], window_s: float) -> list[str]:
    lines = [
        "| system | hang detected (s) | in flight at the hang: failed | started after: ok / failed "
        "| first OK after the hang (s) | all ranks live again (s) | watch ended | commonest error |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for f in hangs:
        if f.error is not None:
            lines.append(f"| {LABELS[f.system]} | failed: {f.error[:200]} | | | | | | |")
            continue
        if f.system == "raydp":
            detected = _fmt(f.detected_s)
        elif f.exited_s is not None:
            detected = f"its server exited at {f.exited_s:.1f} (rc {f.exit_code})"
        else:
            detected = f"never (watched {window_s:g} s)"
        back = _fmt(f.rank_back_s) if f.system == "raydp" else "n/a (no restart)"
        error = next(iter(f.errors), "")
        lines.append(
            f"| {LABELS[f.system]} | {detected} | {f.in_flight_failed}/{f.in_flight} | {f.after_ok} / {f.after_failed} "
            f"| {_fmt(f.first_ok_s)} | {back} | {f.ended} | {error.replace('|', '/')} |"
        )
    return lines


def vllm_table(report: VllmReport) -> list[str]:
    w = report.workload
    turns = max((t.turn for t in report.turns), default=-1) + 1
    ran = {t.system for t in report.turns} | {f.system for f in report.faults}
    systems = tuple(s for s in SYSTEMS if s in ran)
    lines = [
        f"### vLLM engines: raydp DP=2 against vLLM's own DP=2 servers, by `vllm bench serve` ({report.size} "
        f"model, {report.parameters / 1e6:,.1f} M parameters; {w['requests']} requests, {w['concurrency']} in "
        f"flight, prompt {w['prompt_len']} tokens, {w['max_tokens']} out)",
        "",
        f"Same checkpoint ({report.model_dir}), engine flags `{' '.join(report.engine_flags)}`; vLLM's own load "
        f"generator (`vllm bench serve`, streamed completions, ignore_eos) drives every system; {turns} "
        "alternating turn(s) per system and workload, each a fresh start plus warm-up; medians over the turns. "
        "Startup: spawn to the first successful completion. raydp runs `--balancer prefix` on the prefix workload.",
    ]
    for dataset, label in DATASET_LABELS.items():
        mine = [t for t in report.turns if t.dataset == dataset]
        if not mine:
            continue
        sub = VllmReport(report.workload, turns=mine)
        lines += ["", f"Workload: {label}", "", *load_table(sub, systems), "", *ratio_lines(mine)]
    lines += ["", stop_line(report, systems)]
    kills = [f for f in report.faults if f.kind == "kill"]
    hangs = [f for f in report.faults if f.kind == "hang"]
    if kills:
        lines += [
            "",
            f"Fault: SIGKILL rank {KILLED_RANK}'s engine process under the same load (raydp with "
            "--max-restarts 1); times from the kill.",
            "",
            *fault_table(kills),
        ]
    if hangs:
        lines += [
            "",
            f"Hang: the first vLLM worker whose `execute_model` reaches its {HANG_AT_CALL}th call blocks there for "
            "good, under the same load (`benchmarks/vllm_dp/hang_hook`, the same injection in both systems; raydp "
            f"with `--step-timeout-s {STEP_TIMEOUT_S}`); times from the block.",
            "",
            *hang_table(hangs, report.fault_window_s),
        ]
    lines += ["", f"Server logs: {report.log_dir}"]
    return lines
