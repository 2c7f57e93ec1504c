"""Lockstep overhead: the step rate of a busy cluster with waves on and off, against a bare gloo floor."""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import BUSY_MAX_TOKENS, DP_SIZE, ECHO_ENGINE, PROMPT, TIMEOUT_S, Sizes, log, ratio


@dataclass
class StepRate:
    """Steps per second per rank of one busy cluster, median over windows."""

    mode: str
    step_delay_s: float
    steps_per_s: float = 0.0  # mean over ranks of (steps + dummy_steps) / s
    per_rank: list[float] = field(default_factory=list)
    windows: list[float] = field(default_factory=list)
    dummy_fraction: float = 0.0
    collectives_per_s: float = 0.0
    error: str | None = None


MODES = {
    # mode: (lockstep, EchoEngine collective). Dense has no DP group, so its
    # collective=True engine all-reduces nothing: the same engine, lockstep off.
    "dense": (False, True),
    "lockstep": (True, False),
    "lockstep+collective": (True, True),
}
BUSY_STEPS = 64  # steps every rank takes before the warm-up starts (gloo init, first wave)


@contextlib.contextmanager
def busy_cluster(mode: str, step_delay_s: float, name: str) -> Iterator[tuple[Any, Any, Any]]:
    """A DP=2 cluster in ``mode``; yields it, a load client and a probe client for its stats."""
    import raydp

    lockstep, collective = MODES[mode]
    with raydp.launch(
        name=name,
        dp_size=DP_SIZE,
        engine=ECHO_ENGINE,
        lockstep=lockstep,
        engine_kwargs={"collective": collective, "step_delay_s": step_delay_s},
        progress=False,
    ) as cluster:
        # Stats go through a second client: its replies do not queue behind the
        # flood of outputs the first one may be slow to read.
        yield cluster, cluster.client(), cluster.client()


@dataclass
class Window:
    rates: list[float]  # steps/s of each rank
    steps: int
    dummies: int
    collectives: int
    elapsed: float


def busy_window(cluster: Any, load: Any, probe: Any, mode: str, step_delay_s: float, sizes: Sizes) -> Window:
    """Keep both ranks busy, count their steps over one window, then let the cluster go quiet again."""
    busy = sizes.busy_per_rank if step_delay_s else sizes.busy_per_rank_no_delay
    handles = [load.submit(PROMPT, BUSY_MAX_TOKENS, rank=rank) for rank in range(DP_SIZE) for _ in range(busy)]
    try:
        wait_stepping(probe, BUSY_STEPS)
        time.sleep(sizes.step_warmup_s)
        before, t0 = rank_stats(probe), time.perf_counter()
        time.sleep(sizes.step_window_s)
        after, t1 = rank_stats(probe), time.perf_counter()
    finally:
        for handle in handles:
            load.abort(handle.request_id)
        wait_done(handles)
        if MODES[mode][0]:
            wait_paused(cluster)
    ranks = list(zip(before, after, strict=True))

    def grew(key: str) -> list[int]:
        return [a[key] - b[key] for b, a in ranks]

    steps = [n + d for n, d in zip(grew("steps"), grew("dummy_steps"), strict=True)]
    return Window(
        [n / (t1 - t0) for n in steps], sum(steps), sum(grew("dummy_steps")), sum(grew("collectives")), t1 - t0
    )


def step_rates(modes: list[str], step_delay_s: float, sizes: Sizes) -> list[StepRate]:
    """The clusters of ``modes`` open at once, taking turns at being busy (the order rotating),
    one window each per turn: a ratio of two modes is taken between windows seconds apart."""
    found: dict[str, list[Window]] = {mode: [] for mode in modes}
    with contextlib.ExitStack() as stack:
        clusters = {
            mode: stack.enter_context(busy_cluster(mode, step_delay_s, f"bench-step-{i}"))
            for i, mode in enumerate(modes)
        }
        for turn in range(sizes.step_windows):
            for mode in modes[turn % len(modes) :] + modes[: turn % len(modes)]:
                log(f"step rate: {mode}, step_delay_s={step_delay_s}, turn {turn + 1}/{sizes.step_windows}")
                found[mode].append(busy_window(*clusters[mode], mode, step_delay_s, sizes))
    return [_step_rate(mode, step_delay_s, windows) for mode, windows in found.items()]


def _step_rate(mode: str, step_delay_s: float, windows: list[Window]) -> StepRate:
    means = [statistics.fmean(w.rates) for w in windows]
    median = means.index(statistics.median_low(means))
    steps, elapsed = sum(w.steps for w in windows), sum(w.elapsed for w in windows)
    return StepRate(
        mode,
        step_delay_s,
        steps_per_s=means[median],
        per_rank=windows[median].rates,
        windows=means,
        dummy_fraction=sum(w.dummies for w in windows) / steps if steps else 0.0,
        collectives_per_s=sum(w.collectives for w in windows) / DP_SIZE / elapsed,
    )


def rank_stats(client: Any) -> list[dict[str, int]]:
    return [client.call_utility(rank, "stats", timeout=TIMEOUT_S) for rank in range(DP_SIZE)]


def wait_stepping(probe: Any, steps: int, timeout: float = TIMEOUT_S) -> None:
    """Until every rank took ``steps`` steps (a lockstep rank first joins its gloo group)."""
    deadline = time.monotonic() + timeout
    while min(s["steps"] + s["dummy_steps"] for s in rank_stats(probe)) < steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks did not take {steps} steps in {timeout}s")
        time.sleep(0.05)


def wait_done(handles: list[Any], timeout: float = 30.0) -> None:
    """Until every aborted handle has heard of it (the client caught up with its backlog)."""
    deadline = time.monotonic() + timeout
    for handle in handles:
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)


def wait_paused(cluster: Any, timeout: float = 10.0) -> None:
    """Let a lockstep cluster finish its wave, so close() finds no rank in a collective."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and cluster.coordinator_state().running:
        time.sleep(0.05)


def collective_floor_worker(rank: int, port: int, delays: list[float], window_s: float, results: Any) -> None:
    """One of 2 spawned processes: the steps/s of a bare loop, with and without a gloo all-reduce.

    Per delay: ``sleep(delay)`` alone, then ``sleep(delay); all_reduce(1 float)``
    (what EchoEngine's collective step does), each for ``window_s``. Rank 0
    ends the all-reduce loop through the reduced value, so both ranks stop
    on the same step.
    """
    import torch
    import torch.distributed as dist

    from raydp.engine.collective import GlooDPGroup

    GlooDPGroup(f"127.0.0.1:{port}", rank, DP_SIZE, timeout_s=TIMEOUT_S)
    try:
        for _ in range(BUSY_STEPS):
            dist.all_reduce(torch.ones(1))
        rates: dict[float, tuple[float, float]] = {}
        for delay in delays:
            dist.barrier()
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < window_s:
                if delay:
                    time.sleep(delay)
                n += 1
            alone = n / (time.perf_counter() - start)
            dist.barrier()
            n, start = 0, time.perf_counter()
            while True:
                if delay:
                    time.sleep(delay)
                go = torch.ones(1) if rank or time.perf_counter() - start < window_s else torch.zeros(1)
                dist.all_reduce(go, op=dist.ReduceOp.MIN)
                n += 1
                if go.item() == 0:
                    break
            rates[delay] = (alone, n / (time.perf_counter() - start))
        results.put((rank, rates))
    finally:
        dist.destroy_process_group()


def collective_floor(sizes: Sizes) -> dict[float, tuple[float, float]]:
    """Per delay: (bare loop steps/s, bare loop + gloo all-reduce steps/s), mean of 2 ranks."""
    from raydp.engine.collective import Rendezvous

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    rendezvous = Rendezvous("127.0.0.1", DP_SIZE, timeout_s=TIMEOUT_S)
    port = rendezvous.store.port
    window = sizes.step_window_s * sizes.step_windows
    procs = [
        spawn.Process(target=collective_floor_worker, args=(rank, port, list(sizes.step_delays_s), window, results))
        for rank in range(DP_SIZE)
    ]
    for proc in procs:
        proc.start()
    try:
        per_rank = [results.get(timeout=TIMEOUT_S)[1] for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        rendezvous.close()
    return {
        delay: (statistics.fmean(r[delay][0] for r in per_rank), statistics.fmean(r[delay][1] for r in per_rank))
        for delay in sizes.step_delays_s
    }


def lockstep_benchmark(sizes: Sizes) -> tuple[list[StepRate], dict[float, tuple[float, float]] | str]:
    floor: dict[float, tuple[float, float]] | str
    log("step rate: bare loop and gloo all-reduce floor (2 processes, no raydp)")
    try:
        floor = collective_floor(sizes)
    except Exception as exc:
        floor = f"{type(exc).__name__}: {exc}"
    results = []
    for delay in sizes.step_delays_s:
        # The target's two modes side by side; the per-step all-reduce mode alone (4 logical GPUs).
        for modes in (["dense", "lockstep"], ["lockstep+collective"]):
            try:
                results += step_rates(modes, delay, sizes)
            except Exception as exc:
                results += [StepRate(mode, delay, error=f"{type(exc).__name__}: {exc}") for mode in modes]
    return results, floor


# ---- report ----------------------------------------------------------------------------------


def lockstep_table(results: list[StepRate], floor: dict[float, tuple[float, float]] | str, sizes: Sizes) -> list[str]:
    lines = [
        "### Lockstep overhead (DP=2, both ranks busy)",
        "",
        f"Steps per second per rank (steps + dummy steps), median of {sizes.step_windows} window(s) "
        f"of {sizes.step_window_s:g} s. The dense and lockstep clusters are open at once and take turns at "
        "being busy, one window each per turn, so their ratio is taken between windows seconds apart "
        "(the per-step all-reduce cluster runs on its own). allreduce_interval=32. "
        "EchoEngine's `step_delay_s` sleeps in every "
        f"step to stand in for device time ({sizes.busy_per_rank} running requests per rank). "
        f"`step_delay_s=0` is the worst case ({sizes.busy_per_rank_no_delay} requests per rank): the step is "
        "pure raydp + Python overhead, and the driver's client, decoding every output, competes for the "
        "same cores. "
        "The two floor columns run no raydp: 2 processes looping `sleep(step_delay_s)`, "
        "then `sleep(step_delay_s); all_reduce(1 float)` over gloo, as EchoEngine's collective step does.",
        "",
        "| step_delay_s | floor: bare loop | floor: loop + gloo all-reduce | dense | lockstep "
        "| lockstep + per-step all-reduce |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    rows = {(r.mode, r.step_delay_s): r for r in results}
    for delay in sizes.step_delays_s:
        alone, reduced = floor[delay] if isinstance(floor, dict) else (0.0, 0.0)
        cells = [
            "(sleep-free)" if delay == 0 and alone else rate_cell(alone, floor),
            rate_cell(reduced, floor),
        ]
        for mode in MODES:
            r = rows[(mode, delay)]
            cells.append(rate_cell(r.steps_per_s, r.error))
        lines.append(f"| {delay:g} | {' | '.join(cells)} |")
    lines += [
        "",
        "The issue's target is the first ratio: the same engine with lockstep on and off. The per-step "
        "all-reduce is the model's own collective (an expert-parallel forward pass), which a dense cluster "
        "cannot run; its columns say how much of that cost is gloo's rather than raydp's.",
        "",
        "| step_delay_s | **lockstep / dense** | >= 0.8 | lockstep + per-step all-reduce / dense "
        "| raydp cost: dense / bare loop | raydp cost: lockstep + all-reduce / gloo floor |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for delay in sizes.step_delays_s:
        dense, lock, coll = (rows[(m, delay)].steps_per_s for m in MODES)
        alone, reduced = floor[delay] if isinstance(floor, dict) else (0.0, 0.0)
        verdict = "n/a" if dense <= 0 or lock <= 0 else ("yes" if lock / dense >= 0.8 else "NO")
        lines.append(
            f"| {delay:g} | **{ratio(lock, dense)}** | {verdict} | {ratio(coll, dense)} "
            f"| {ratio(dense, alone) if delay else 'n/a'} | {ratio(coll, reduced)} |"
        )
    for delay in sizes.step_delays_s:
        pairs = [
            a / b for a, b in zip(rows[("lockstep", delay)].windows, rows[("dense", delay)].windows, strict=False) if b
        ]
        if len(pairs) > 1:
            lines.append(
                f"\nlockstep / dense at step_delay_s={delay:g}, turn by turn: {', '.join(f'{p:.2f}' for p in pairs)}"
            )
    return lines


def rate_cell(rate: float, error: object) -> str:
    if isinstance(error, str):
        return f"failed: {error}"
    return f"{rate:,.0f}" if rate > 0 else "n/a"
