"""The vLLM benchmark's turns: each system started fresh, loaded, and once more with rank 1 killed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

from benchmarks.common import log
from benchmarks.vllm_dp.bench_serve import bench_serve, dataset_args
from benchmarks.vllm_dp.load import (
    closed_loop,
    make_prompts,
    wait_ready,
)
from benchmarks.vllm_dp.servers import Server, ServerError, spawn, title_of

SYSTEMS = ("raydp", "vllm", "vllm-ray", "serve-llm")
DATASETS = ("random", "prefix")


KILLED_RANK = 1


# (layers, hidden, heads, vocabulary) by --size: head_dim 64, as vLLM's CPU attention wants. "tiny": the plumbing
# shows; "compute": about 90 M parameters in float32 (the embedded corpus gives the BPE some 1,450 tokens),
# where the engine dominates as it does on a GPU.
SIZES = {"tiny": (2, 256, 4, 1024), "compute": (8, 1024, 16, 2048)}


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
    prefix_len: int = 96  # the prefix workload: shared prefixes of this many tokens (of prompt_len)
    num_prefixes: int = 8


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
    hangs: bool = True  # the hang turn too (one vLLM worker blocked in execute_model)
    omp_threads: int = 1
    size: str = "tiny"
    datasets: tuple[str, ...] = DATASETS


QUICK = Options(Workload(requests=64), turns=1)


FULL = Options(Workload())


@dataclass
class TurnResult:
    """One measured turn of one system; latencies in ms."""

    system: str
    turn: int
    dataset: str = "random"
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
    """A fault turn of one system under load: rank 1's engine SIGKILLed (``kill``), or one engine's executor
    blocked in ``execute_model`` for good (``hang``); times in s from the fault."""

    system: str
    kind: str = "kill"
    target: str = ""
    detected_s: float | None = None  # the hang: raydp's /metrics counted it (raydp_rank_hangs_total)
    startup_s: float | None = None
    in_flight: int = 0  # requests running at the kill
    in_flight_failed: int = 0
    after_ok: int = 0  # requests started after the kill
    after_failed: int = 0
    first_ok_s: float | None = None  # first success among those started after the kill
    last_failed_s: float | None = None  # start of the last failure among those (new requests failed until then)
    rank_back_s: float | None = None  # the killed rank reported live again (raydp's /metrics: raydp_rank_dead)
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
    """Everything one run measured (the ``vllm`` section of ``python -m benchmarks``)."""

    workload: dict[str, Any]
    turns: list[TurnResult] = field(default_factory=list)
    faults: list[FaultResult] = field(default_factory=list)
    model_dir: str = ""
    log_dir: str = ""
    engine_flags: list[str] = field(default_factory=list)
    size: str = "tiny"
    parameters: int = 0
    fault_window_s: float = 90.0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def engine_flags(w: Workload) -> list[str]:
    """vLLM's engine flags, the same for both systems."""
    max_len = max(1024, w.prompt_len + w.max_tokens)
    return [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_len),
        "--max-num-seqs",
        str(max(32, w.concurrency)),
    ]


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
    """Startup, a warm-up, then ``vllm bench serve`` (:mod:`.bench_serve`) on the turn's dataset."""
    w, timeout_s = setup.opts.workload, setup.opts.request_timeout_s
    result.startup_s = await wait_ready(server, setup.opts.startup_timeout_s)
    await warm_up(server, w, setup.vocab, timeout_s)
    dataset = dataset_args(result.dataset, w.prompt_len, w.max_tokens, w.prefix_len, w.num_prefixes)
    done = await asyncio.to_thread(
        bench_serve, server.url, setup.model, dataset, w.requests, w.concurrency, w.seed, timeout_s * 4
    )
    from_bench_serve(result, done)
    log(f"{server.system}: {result.tok_s or 0:,.0f} output tok/s, {result.failed} failed of {result.requests}")
    return result


def from_bench_serve(result: TurnResult, done: dict[str, Any]) -> None:
    """The turn's figures as ``vllm bench serve`` measured them."""
    result.requests = int(done["completed"]) + int(done.get("failed", 0))
    result.failed = int(done.get("failed", 0))
    result.first_error = next((e for e in done.get("errors", []) if e), None)
    result.output_tokens = int(done["total_output_tokens"])
    result.wall_s = float(done["duration"])
    result.tok_s = float(done["output_throughput"])
    result.ttft_p50_ms, result.ttft_p99_ms = done.get("median_ttft_ms"), done.get("p99_ttft_ms")
    result.itl_p50_ms, result.e2e_p50_ms = done.get("median_itl_ms"), done.get("median_e2el_ms")


def run_turn(
    setup: Setup,
    system: str,
    tag: str,
    result: R,
    load: Callable[[Setup, Server, R], Coroutine[Any, Any, object]],
    dataset: str = "random",
    env: dict[str, str] | None = None,
) -> R:
    """One fresh server start under ``load``; a failed turn is reported in ``result``, not fatal."""
    # raydp runs as its users would for the workload: the prefix policy where prompts share prefixes.
    extra: list[str] = ["--balancer", "prefix"] if system == "raydp" and dataset == "prefix" else []
    flags = [*setup.flags, *extra]
    server = spawn(system, setup.model, flags, setup.log_dir, tag, setup.opts.omp_threads, env)
    try:
        asyncio.run(load(setup, server, result))
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:600]
        log(f"{system} turn {tag} failed: {result.error}")
    finally:
        result.leftover = server.stop()
        result.stop_s, result.stop_forced = server.stop_s, server.stop_forced
    return result


def measure(setup: Setup, system: str, turn: int, dataset: str) -> TurnResult:
    return run_turn(setup, system, f"{dataset}{turn}", TurnResult(system, turn, dataset), load_turn, dataset)


def build_model(model_dir: str | None, size: str) -> str:
    from raydp.models.checkpoint import default_model_dir, make_model

    layers, hidden, heads, vocab = SIZES[size]
    default = default_model_dir().parent / f"bench-vllm-l{layers}-h{hidden}-v{vocab}"
    path = make_model(model_dir or default, layers=layers, hidden_size=hidden, heads=heads, vocab_size=vocab)
    return str(path)


def vllm_failed(report: VllmReport) -> bool:
    return any(t.error or t.failed or t.leftover for t in report.turns) or any(
        f.error or f.leftover for f in report.faults
    )
