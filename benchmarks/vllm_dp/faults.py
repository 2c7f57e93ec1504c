"""The vLLM benchmark's fault turns: rank 1's engine SIGKILLed under load, or one worker hung (see ``hang_hook``).

Each turn is a fresh server under a closed-loop load; the watch records when
the fault was seen, when requests answered again and when the rank came back.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp

from benchmarks.common import log
from benchmarks.vllm_dp.load import (
    Sample,
    all_ranks_live,
    client_session,
    completion_body,
    hangs_counted,
    rank_live,
    stream_completion,
    wait_ready,
)
from benchmarks.vllm_dp.run import KILLED_RANK, FaultResult, Setup, find_engine, run_turn, warm_up
from benchmarks.vllm_dp.servers import REPO, Server, ServerError, title_of


async def fault_load(setup: Setup, server: Server, result: FaultResult) -> None:
    """Closed-loop load; rank 1's engine killed once it runs; watched until it is back, the server dies, or time."""
    w, window = setup.opts.workload, setup.opts.fault_window_s
    result.startup_s = await wait_ready(server, setup.opts.startup_timeout_s)
    await warm_up(server, w, setup.vocab, setup.opts.request_timeout_s)
    samples: list[Sample] = []
    stop = asyncio.Event()
    kill_at = time.monotonic()  # reset at the kill
    async with client_session(w.concurrency) as session:
        workers = [
            asyncio.create_task(fault_worker(session, server, setup, samples, stop, i)) for i in range(w.concurrency)
        ]
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


HANG_AT_CALL = 120  # the Nth execute_model of a worker blocks: past the warm-up, early in the load
HANG_HOOK = Path(__file__).resolve().parent / "hang_hook"


def hang_env(marker: Path) -> dict[str, str]:
    """What arms :mod:`hang_hook <benchmarks.vllm_dp.hang_hook.sitecustomize>` in the server's processes."""
    return {"PYTHONPATH": f"{HANG_HOOK}:{REPO}", "RAYDP_BENCH_HANG": f"{HANG_AT_CALL}:{marker}"}


async def hang_load(setup: Setup, server: Server, result: FaultResult) -> None:
    """Closed-loop load until one worker's ``execute_model`` blocks (its marker appears); watched as after a kill."""
    w, window = setup.opts.workload, setup.opts.fault_window_s
    marker = Path(server_marker(server))
    result.startup_s = await wait_ready(server, setup.opts.startup_timeout_s)
    await warm_up(server, w, setup.vocab, setup.opts.request_timeout_s)
    samples: list[Sample] = []
    stop = asyncio.Event()
    hang_at = time.monotonic()
    async with client_session(w.concurrency) as session:
        workers = [
            asyncio.create_task(fault_worker(session, server, setup, samples, stop, i)) for i in range(w.concurrency)
        ]
        try:
            await until(marker.exists, 120.0)
            hang_at = time.monotonic() - max(0.0, time.time() - marker.stat().st_mtime)
            result.target = f"execute_model call {HANG_AT_CALL} of the first worker there"
            log(f"{server.system}: a worker's execute_model blocked")
            result.ended = await watch(server, samples, hang_at, window, result)
        finally:
            stop.set()
            await finish(workers, 30.0)
    tally(result, samples, hang_at)


def server_marker(server: Server) -> str:
    return str(server.log_path.with_suffix(".hung"))


async def fault_worker(
    session: aiohttp.ClientSession, server: Server, setup: Setup, samples: list[Sample], stop: asyncio.Event, index: int
) -> None:
    w = setup.opts.workload
    n = index
    while not stop.is_set():
        sample = Sample(time.monotonic())
        samples.append(sample)
        prompt = setup.prompts[n % len(setup.prompts)]
        await stream_completion(
            session, server.url, completion_body(prompt, w.max_tokens, server.ignore_eos), sample, 60.0
        )
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
    seen_dead = False  # raydp: the rank is back once reported dead, then live again
    while True:
        await asyncio.sleep(0.25)
        server.refresh()
        now = time.monotonic()
        if server.proc.poll() is not None:  # the supervisor exits with the server's code
            result.exited_s, result.exit_code = now - kill_at, server.proc.returncode
            await asyncio.sleep(2.0)  # the requests in flight see the end
            return "server exited"
        raydp, hang = server.system == "raydp", result.kind == "hang"
        if raydp and hang and result.detected_s is None and await hangs_counted(server.url) > 0:
            result.detected_s = now - kill_at
        if result.rank_back_s is None and raydp:
            # The hang hits whichever engine gets there first: back means every rank live again.
            live = await all_ranks_live(server.url) if hang else await rank_live(server.url, KILLED_RANK)
            seen_dead = seen_dead or not live
            if live and seen_dead:
                result.rank_back_s = now - kill_at
        if result.rank_back_s is not None and now - kill_at > result.rank_back_s + 2.0:
            return "killed rank back"
        if now - kill_at > window_s:
            return f"window of {window_s:g} s over"


async def finish(workers: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Let the requests in flight end (their own timeouts bound them), then cancel what is left."""
    _, pending = await asyncio.wait(workers, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def first_ok(samples: list[Sample], kill_at: float) -> float | None:
    """Seconds from the kill to the first success among requests started after it."""
    return min((s.end - kill_at for s in samples if s.ok and s.start > kill_at), default=None)


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
    result.watched_s = max((s.end for s in samples), default=kill_at) - kill_at
    errors = Counter(str(s.error)[:100] for s in samples if s.error)
    result.errors = dict(errors.most_common(3))


def fault_turn(setup: Setup, system: str) -> FaultResult:
    return run_turn(setup, system, "fault", FaultResult(system), fault_load)


def hang_turn(setup: Setup, system: str) -> FaultResult:
    marker = setup.log_dir / f"{system}-hang.hung"  # server_marker() of the server this turn spawns
    return run_turn(setup, system, "hang", FaultResult(system, kind="hang"), hang_load, env=hang_env(marker))
