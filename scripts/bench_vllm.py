#!/usr/bin/env python3
"""The LLM-level anchor: raydp with vLLM engines (DP=2) against vLLM's own ``--data-parallel-size 2`` server.

Run as ``.venv/bin/python scripts/bench_vllm.py [--quick] [--requests N] [--concurrency N]
[--prompt-len N] [--max-tokens N] [--turns N] [--model-dir DIR] [--no-faults] [--json PATH]``,
or as the opt-in ``vllm`` section of ``scripts/bench.py`` (``--only vllm``).

Both systems serve the same small Llama checkpoint (``make_model``, built once
into ``~/.cache/raydp/models/`` unless ``--model-dir``), with the same vLLM
engine flags (float32, eager, max-model-len 1024, max-num-seqs 32) and the same
environment (``VLLM_CPU_KVCACHE_SPACE=1``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``,
``OMP_NUM_THREADS=1``: what Ray gives raydp's rank actors anyway; vLLM's engine
cores would otherwise each take every core, ``--omp-threads`` changes it for both):

* raydp: ``raydp serve --engine vllm --dp-size 2 --api-servers 1
  --accelerator CPU --max-restarts 1 --address local`` (``local``: a Ray of
  its own, with the CPUs the plan needs, even if another Ray runs on the
  machine);
* vLLM: ``python -m vllm.entrypoints.openai.api_server --data-parallel-size 2``
  (one API server, engine cores in its own multiprocessing).

Workload: seeded random token-id prompts of ``--prompt-len`` tokens,
``max_tokens`` with ``ignore_eos`` (every request makes exactly that many
tokens), streamed ``POST /v1/completions``, a closed loop of ``--concurrency``
requests in flight, ``--requests`` in all. One asyncio client (aiohttp) drives
both. Per request: TTFT (the first chunk that carries tokens), the inter-token
gaps (a chunk's gap is split evenly over its tokens: ``choices[0].token_ids``
when the server sends them, else one token a chunk), end-to-end latency and the
output tokens (the usage chunk's ``completion_tokens``).

Fairness: the systems never run at once; they take turns (raydp, vLLM, raydp,
vLLM, ...), each turn a fresh server start and a few warm-up requests before
the measured ones; the table shows medians over the turns. Startup is from
spawning the server command to its first successful completion.

Fault row (one more turn per system unless ``--no-faults``): under the same
closed-loop load, SIGKILL rank 1's engine process (raydp: the Ray actor titled
``raydp::<name> dp1 ...``; vLLM: ``VLLM::EngineCore_DP1``) and watch for up to
``--fault-window`` seconds: the requests in flight that failed, whether
requests started after the kill succeed, the time to the first such success,
and, for raydp, the time until the restarted rank answers again (choices carry
the rank). Every server is stopped in a ``finally`` (SIGTERM, then SIGKILL to
its process group and every descendant seen), and runs under a small
supervisor that stops it if the bench itself dies, so nothing is left running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import psutil
from bench_common import log
from bench_vllm_load import (
    Sample,
    client_session,
    closed_loop,
    completion_body,
    make_prompts,
    ms,
    percentile,
    stream_completion,
    wait_ready,
)
from bench_vllm_servers import Server, ServerError, spawn, title_of

REPO = Path(__file__).resolve().parent.parent


SYSTEMS = ("raydp", "vllm")




KILLED_RANK = 1


LAYERS, HIDDEN, HEADS = 2, 256, 4  # head_dim 64, as vLLM's CPU attention wants


THROUGHPUT_TARGET, TTFT_TARGET, STARTUP_TARGET = 1.0, 1.0, 1.0


# raydp's CLI, in a process that starts its own Ray first (see the module docstring).
@dataclass(frozen=True)
class Workload:
    requests: int = 256
    concurrency: int = 16
    prompt_len: int = 128
    max_tokens: int = 64
    seed: int = 0
    warmup: int = 4  # untimed requests after each start


@dataclass(frozen=True)
class Options:
    workload: Workload
    turns: int = 2
    faults: bool = True
    model_dir: str | None = None
    systems: tuple[str, ...] = SYSTEMS
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 300.0
    fault_window_s: float = 90.0
    omp_threads: int = 1


QUICK = Options(Workload(requests=64), turns=1)


FULL = Options(Workload())


@dataclass
class TurnResult:
    """One measured turn of one system; latencies in ms."""

    system: str
    turn: int
    startup_s: float | None = None
    ignore_eos: bool = True
    requests: int = 0
    failed: int = 0
    first_error: str | None = None
    output_tokens: int = 0
    wall_s: float = 0.0
    tok_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    e2e_p50_ms: float | None = None
    stop_s: float | None = None  # SIGTERM to the server's exit
    stop_forced: bool = False  # it outlasted the grace: SIGKILL
    leftover: list[str] = field(default_factory=list)
    error: str | None = None
    per_request: list[dict[str, Any]] = field(default_factory=list)  # raw: start, ttft, e2e, tokens, error


@dataclass
class FaultResult:
    """The fault turn of one system: rank 1's engine SIGKILLed under load; times in s from the kill."""

    system: str
    target: str = ""
    startup_s: float | None = None
    in_flight: int = 0  # requests running at the kill
    in_flight_failed: int = 0
    after_ok: int = 0  # requests started after the kill
    after_failed: int = 0
    first_ok_s: float | None = None  # first success among those started after the kill
    last_failed_s: float | None = None  # start of the last failure among those (new requests failed until then)
    rank_back_s: float | None = None  # first success from the killed rank (raydp's choices name the rank)
    exited_s: float | None = None  # the server process exited
    exit_code: int | None = None
    ended: str = ""  # why the watch stopped
    watched_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)  # the commonest error messages
    stop_s: float | None = None
    stop_forced: bool = False
    leftover: list[str] = field(default_factory=list)
    error: str | None = None


R = TypeVar("R", "TurnResult", "FaultResult")  # what a turn fills in


@dataclass
class VllmReport:
    """Everything one run measured (``bench.py``'s ``vllm`` section)."""

    workload: dict[str, Any]
    turns: list[TurnResult] = field(default_factory=list)
    faults: list[FaultResult] = field(default_factory=list)
    model_dir: str = ""
    log_dir: str = ""
    engine_flags: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def engine_flags(w: Workload) -> list[str]:
    """vLLM's engine flags, the same for both systems."""
    max_len = max(1024, w.prompt_len + w.max_tokens)
    return ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_len),
            "--max-num-seqs", str(max(32, w.concurrency))]


def find_engine(server: Server) -> psutil.Process:
    """Rank 1's engine process, by the title each system gives it."""
    needle = f"raydp::{server.name} dp{KILLED_RANK} " if server.system == "raydp" else f"EngineCore_DP{KILLED_RANK}"
    for p in server.refresh():
        with contextlib.suppress(psutil.Error):
            if needle in title_of(p) or needle in p.name():
                return p
    raise ServerError(f"no process titled {needle!r} below pid {server.proc.pid}")


async def warm_up(server: Server, w: Workload, vocab: int, timeout_s: float) -> None:
    # Other prompts than the measured ones: the measured ones must not hit the prefix cache.
    prompts = make_prompts(w.warmup, w.prompt_len, vocab, w.seed + 1)
    samples, _ = await closed_loop(server, prompts, min(16, w.max_tokens), max(1, w.warmup), timeout_s)
    if not any(s.ok for s in samples):
        raise ServerError(f"{server.system}: every warm-up request failed: {samples[0].error}")


def summarize(result: TurnResult, samples: list[Sample], wall_s: float) -> None:
    good = [s for s in samples if s.ok]
    bad = [s for s in samples if not s.ok]
    result.requests, result.failed = len(samples), len(bad)
    result.first_error = bad[0].error if bad else None
    result.output_tokens = sum(s.tokens for s in good)
    result.wall_s = wall_s
    result.tok_s = result.output_tokens / wall_s if wall_s > 0 else None
    ttfts = [s.ttft for s in good if s.ttft is not None]
    result.ttft_p50_ms, result.ttft_p99_ms = ms(percentile(ttfts, 50)), ms(percentile(ttfts, 99))
    result.itl_p50_ms = ms(percentile([g for s in good for g in s.itl], 50))
    result.e2e_p50_ms = ms(percentile([s.end - s.start for s in good], 50))
    t0 = min((s.start for s in samples), default=0.0)
    result.per_request = [{"start_s": round(s.start - t0, 4), "ttft_ms": ms(s.ttft),
                           "e2e_ms": ms(s.end - s.start), "tokens": s.tokens, "rank": s.rank, "error": s.error}
                          for s in samples]


@dataclass(frozen=True)
class Setup:
    """What every turn of one run shares."""

    opts: Options
    model: str
    vocab: int
    flags: list[str]
    log_dir: Path
    prompts: list[list[int]]


async def load_turn(setup: Setup, server: Server, result: TurnResult) -> TurnResult:
    w, timeout_s = setup.opts.workload, setup.opts.request_timeout_s
    result.startup_s = await wait_ready(server, setup.opts.startup_timeout_s)
    await warm_up(server, w, setup.vocab, timeout_s)
    samples, wall = await closed_loop(server, setup.prompts, w.max_tokens, w.concurrency, timeout_s)
    result.ignore_eos = server.ignore_eos
    summarize(result, samples, wall)
    log(f"{server.system}: {result.tok_s or 0:,.0f} output tok/s, {result.failed} failed of {result.requests}")
    return result


def run_turn(
    setup: Setup, system: str, tag: str, result: R, load: Callable[[Setup, Server, R], Coroutine[Any, Any, object]]
) -> R:
    """One fresh server start under ``load``; a failed turn is reported in ``result``, not fatal."""
    server = spawn(system, setup.model, setup.flags, setup.log_dir, tag, setup.opts.omp_threads)
    try:
        asyncio.run(load(setup, server, result))
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:600]
        log(f"{system} turn {tag} failed: {result.error}")
    finally:
        result.leftover = server.stop()
        result.stop_s, result.stop_forced = server.stop_s, server.stop_forced
    return result


def measure(setup: Setup, system: str, turn: int) -> TurnResult:
    return run_turn(setup, system, f"t{turn}", TurnResult(system, turn), load_turn)


async def fault_load(setup: Setup, server: Server, result: FaultResult) -> None:
    """Closed-loop load; rank 1's engine killed once it runs; watched until it is back, the server dies, or time."""
    w, window = setup.opts.workload, setup.opts.fault_window_s
    result.startup_s = await wait_ready(server, setup.opts.startup_timeout_s)
    await warm_up(server, w, setup.vocab, setup.opts.request_timeout_s)
    samples: list[Sample] = []
    stop = asyncio.Event()
    kill_at = time.monotonic()  # reset at the kill
    async with client_session(w.concurrency) as session:
        workers = [asyncio.create_task(fault_worker(session, server, setup, samples, stop, i))
                   for i in range(w.concurrency)]
        try:
            await until(lambda: sum(s.end > 0 for s in samples) >= w.concurrency, 60.0)
            victim = find_engine(server)
            result.target = f"pid {victim.pid} {title_of(victim)[:50].strip()}"
            kill_at = time.monotonic()
            victim.kill()
            log(f"{server.system}: SIGKILL {result.target}")
            result.ended = await watch(server, samples, kill_at, window, result)
        finally:
            stop.set()
            await finish(workers, 30.0)
    tally(result, samples, kill_at)


async def fault_worker(session: aiohttp.ClientSession, server: Server, setup: Setup, samples: list[Sample],
                       stop: asyncio.Event, index: int) -> None:
    w = setup.opts.workload
    n = index
    while not stop.is_set():
        sample = Sample(time.monotonic())
        samples.append(sample)
        prompt = setup.prompts[n % len(setup.prompts)]
        await stream_completion(session, server.url, completion_body(prompt, w.max_tokens, server.ignore_eos),
                                sample, 60.0)
        n += w.concurrency
        if not sample.ok:
            await asyncio.sleep(0.5)  # a dead server refuses at once: no busy loop


async def until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise ServerError(f"the load did not get going within {timeout_s:g} s")
        await asyncio.sleep(0.1)


async def watch(server: Server, samples: list[Sample], kill_at: float, window_s: float, result: FaultResult) -> str:
    while True:
        await asyncio.sleep(0.25)
        server.refresh()
        now = time.monotonic()
        if server.proc.poll() is not None:  # the supervisor exits with the server's code
            result.exited_s, result.exit_code = now - kill_at, server.proc.returncode
            await asyncio.sleep(2.0)  # the requests in flight see the end
            return "server exited"
        back = first_ok(samples, kill_at, KILLED_RANK)
        if back is not None and now - kill_at > back + 2.0:
            return "killed rank back"
        if now - kill_at > window_s:
            return f"window of {window_s:g} s over"


async def finish(workers: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Let the requests in flight end (their own timeouts bound them), then cancel what is left."""
    _, pending = await asyncio.wait(workers, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def first_ok(samples: list[Sample], kill_at: float, rank: int | None = None) -> float | None:
    """Seconds from the kill to the first success among requests started after it (from ``rank``, if given)."""
    ends = [s.end - kill_at for s in samples
            if s.ok and s.start > kill_at and (rank is None or s.rank == rank)]
    return min(ends, default=None)


def tally(result: FaultResult, samples: list[Sample], kill_at: float) -> None:
    for s in samples:
        if s.end == 0:
            s.error, s.end = "cut: still running when the bench stopped", time.monotonic()
    in_flight = [s for s in samples if s.start <= kill_at < s.end]
    after = [s for s in samples if s.start > kill_at]
    result.in_flight = len(in_flight)
    result.in_flight_failed = sum(not s.ok for s in in_flight)
    result.after_ok = sum(s.ok for s in after)
    result.after_failed = len(after) - result.after_ok
    result.first_ok_s = first_ok(samples, kill_at)
    result.last_failed_s = max((s.start - kill_at for s in after if not s.ok), default=None)
    if result.system == "raydp":
        result.rank_back_s = first_ok(samples, kill_at, KILLED_RANK)
    result.watched_s = max((s.end for s in samples), default=kill_at) - kill_at
    errors = Counter(str(s.error)[:100] for s in samples if s.error)
    result.errors = dict(errors.most_common(3))


def fault_turn(setup: Setup, system: str) -> FaultResult:
    return run_turn(setup, system, "fault", FaultResult(system), fault_load)


def build_model(model_dir: str | None) -> str:
    from raydp.models.checkpoint import default_model_dir, make_model

    default = default_model_dir().parent / f"bench-vllm-l{LAYERS}-h{HIDDEN}"
    return str(make_model(model_dir or default, layers=LAYERS, hidden_size=HIDDEN, heads=HEADS))


def run_benchmark(opts: Options) -> VllmReport:
    model = build_model(opts.model_dir)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    w = opts.workload
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    setup = Setup(opts, model, vocab, engine_flags(w), log_dir,
                  make_prompts(w.requests, w.prompt_len, vocab, w.seed))
    report = VllmReport(asdict(w), model_dir=model, log_dir=str(log_dir), engine_flags=setup.flags)
    for turn in range(opts.turns):
        for system in opts.systems:  # alternating: a slow minute of the machine hits both
            report.turns.append(measure(setup, system, turn))
    if opts.faults:
        for system in opts.systems:
            report.faults.append(fault_turn(setup, system))
    return report


def vllm_benchmark(quick: bool) -> VllmReport:
    """``bench.py``'s entry point."""
    return run_benchmark(QUICK if quick else FULL)


def vllm_failed(report: VllmReport) -> bool:
    return (any(t.error or t.failed or t.leftover for t in report.turns)
            or any(f.error or f.leftover for f in report.faults))


METRICS = (("tok_s", "output tok/s"), ("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"),
           ("itl_p50_ms", "ITL p50 (ms)"), ("e2e_p50_ms", "E2E p50 (ms)"), ("startup_s", "startup (s)"))


TARGETS = (("tok_s", "throughput", ">=", THROUGHPUT_TARGET), ("ttft_p50_ms", "TTFT p50", "<=", TTFT_TARGET),
           ("startup_s", "startup", "<=", STARTUP_TARGET))


LABELS = {"raydp": "raydp (vllm engines, DP=2)", "vllm": "vLLM --data-parallel-size 2"}


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
    lines = ["| system | turns | " + " | ".join(label for _, label in METRICS) + " | failed requests |",
             "|---|---:|" + "---:|" * len(METRICS) + "---|"]
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


def ratio_lines(report: VllmReport) -> list[str]:
    ours, theirs = medians(report.turns, "raydp"), medians(report.turns, "vllm")
    cells = " | ".join(_times(_ratio(ours[key], theirs[key])) for key, _ in METRICS)
    lines = [f"| raydp / vLLM | | {cells} | |", ""]
    for key, name, sense, target in TARGETS:
        value = _ratio(ours[key], theirs[key])
        met = value is not None and (value >= target if sense == ">=" else value <= target)
        lines.append(f"- {name}: raydp/vLLM = {_times(value)}, target {sense} {target:g}: "
                     f"{'met' if met else 'NOT met'}")
    return lines


def fault_table(faults: list[FaultResult]) -> list[str]:
    lines = ["| system | killed | in flight at kill: failed | started after: ok / failed | first OK after kill (s) "
             "| new requests failed until (s) | killed rank back (s) | server exited (s) | watch ended "
             "| commonest error |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for f in faults:
        if f.error is not None:
            lines.append(f"| {LABELS[f.system]} | failed: {f.error[:200]} | | | | | | | | |")
            continue
        exited = "no" if f.exited_s is None else f"{f.exited_s:.1f} (rc {f.exit_code})"
        back = _fmt(f.rank_back_s) if f.system == "raydp" else "n/a (no restart)"
        error = next(iter(f.errors), "")
        lines.append(f"| {LABELS[f.system]} | {f.target} | {f.in_flight_failed}/{f.in_flight} "
                     f"| {f.after_ok} / {f.after_failed} | {_fmt(f.first_ok_s)} | {_fmt(f.last_failed_s)} | {back} "
                     f"| {exited} | {f.ended} "
                     f"| {error.replace('|', '/')} |")
    return lines


def vllm_table(report: VllmReport) -> list[str]:
    w = report.workload
    turns = max((t.turn for t in report.turns), default=-1) + 1
    ran = {t.system for t in report.turns} | {f.system for f in report.faults}
    systems = tuple(s for s in SYSTEMS if s in ran)
    no_eos = sorted({t.system for t in report.turns if not t.ignore_eos})
    lines = [
        f"### vLLM engines: raydp DP=2 against vLLM's own DP=2 server ({w['requests']} requests, "
        f"{w['concurrency']} in flight, prompt {w['prompt_len']} tokens, max_tokens={w['max_tokens']})",
        "",
        f"Same checkpoint ({report.model_dir}), engine flags `{' '.join(report.engine_flags)}`, one aiohttp client, "
        f"streamed completions with ignore_eos; {turns} alternating turn(s) per system, each a fresh start plus "
        "warm-up; medians over the turns. Startup: spawn to the first successful completion.",
    ]
    if no_eos:
        lines.append(f"NOTE: {', '.join(no_eos)} refused ignore_eos: measured without it (outputs may end early).")
    if report.turns:
        lines += ["", *load_table(report, systems)]
    if {t.system for t in report.turns} == set(SYSTEMS):
        lines += ratio_lines(report)
    lines += ["", stop_line(report, systems)]
    if report.faults:
        lines += ["", f"Fault: SIGKILL rank {KILLED_RANK}'s engine process under the same load (raydp with "
                  "--max-restarts 1); times from the kill.", "", *fault_table(report.faults)]
    lines += ["", f"Server logs: {report.log_dir}"]
    return lines


def options_from(args: argparse.Namespace) -> Options:
    base = QUICK if args.quick else FULL
    w = base.workload
    workload = Workload(requests=args.requests or w.requests, concurrency=args.concurrency or w.concurrency,
                        prompt_len=args.prompt_len or w.prompt_len, max_tokens=args.max_tokens or w.max_tokens,
                        seed=args.seed)
    return Options(workload, turns=base.turns if args.turns is None else args.turns, faults=not args.no_faults,
                   model_dir=args.model_dir, systems=tuple(args.system or SYSTEMS), fault_window_s=args.fault_window,
                   omp_threads=args.omp_threads)


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the finally blocks stop the servers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="64 requests, 1 turn per system")
    parser.add_argument("--requests", type=int, help="measured requests per turn (default 256)")
    parser.add_argument("--concurrency", type=int, help="requests in flight (default 16)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default 128)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (default 64)")
    parser.add_argument("--turns", type=int,
                        help="measured turns per system (default 2; 1 with --quick; 0: the fault turns only)")
    parser.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of every engine (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", help="checkpoint directory (default: build the small model into the cache)")
    parser.add_argument("--no-faults", action="store_true", help="leave out the fault turns")
    parser.add_argument("--fault-window", type=float, default=90.0, help="seconds to watch after the kill")
    parser.add_argument("--system", action="append", choices=SYSTEMS, help="run only this system (repeatable)")
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
