"""Autoscaling under a step load: autoscaled against a fixed minimum and a fixed maximum, in one run.

The ``mp`` backend runs ``EchoEngine`` ranks that each run at most
``MAX_RUNNING`` requests at a time with ``STEP_S`` per step, so a rank serves
about ``MAX_RUNNING / (TOKENS * STEP_S)`` requests a second and more load
needs more ranks. Open-loop (Poisson) arrivals follow a step: low, high, low.
Each system gets the same seeded arrival times:

* fixed at the minimum (1 rank): cheap, and it drowns in the high phase;
* fixed at the maximum (``MAX_DP`` ranks): fast, and it pays for every rank all along;
* autoscaled in ``[1, MAX_DP]``: raydp's autoscaler, with short delays.

Reported: latency p50 and p99 (from a request's scheduled arrival to its
last token, so queueing counts), and rank-seconds (the size, sampled every
``SAMPLE_S``, integrated over the run). Targets: the autoscaled p99 within
1.2x of the fixed maximum's, at no more than 0.7x its rank-seconds.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import raydp
from benchmarks.common import log

MAX_DP = 3
MAX_RUNNING, STEP_S, TOKENS = 2, 0.005, 20  # 0.1 s a request; 20 requests/s a rank
SAMPLE_S = 0.1
P99_TARGET, RANK_SECONDS_TARGET = 1.2, 0.7
SCALING = {
    "min_dp_size": 1,
    "max_dp_size": MAX_DP,
    "target_ongoing_requests": 1.5,
    "upscale_delay_s": 0.0,
    "downscale_delay_s": 1.0,
    "look_back_s": 0.3,
    "interval_s": 0.05,
    "drain_timeout_s": 10.0,
}


@dataclass(frozen=True)
class Step:
    """The load: ``low`` requests/s for ``before`` s, ``high`` for ``during``, ``low`` again for ``after``."""

    low: float
    high: float
    before: float
    during: float
    after: float

    def arrivals(self, seed: int) -> list[float]:
        rng, t, out = random.Random(seed), 0.0, []
        for rate, end in (
            (self.low, self.before),
            (self.high, self.before + self.during),
            (self.low, self.before + self.during + self.after),
        ):
            while True:
                t += rng.expovariate(rate)
                if t >= end:
                    t = end
                    break
                out.append(t)
        return out


STEP_FULL = Step(low=8.0, high=48.0, before=40.0, during=40.0, after=40.0)
STEP_QUICK = Step(low=8.0, high=48.0, before=3.0, during=8.0, after=8.0)


@dataclass
class AutoscaleResult:
    system: str
    requests: int = 0
    errors: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    rank_seconds: float = 0.0
    peak: int = 0
    error: str = ""
    latencies: list[float] = field(default_factory=list, repr=False)


def autoscale_benchmark(step: Step, seed: int = 7) -> list[AutoscaleResult]:
    arrivals = step.arrivals(seed)
    systems: list[tuple[str, dict[str, Any]]] = [
        ("fixed minimum (1 rank)", {"dp_size": 1}),
        (f"fixed maximum ({MAX_DP} ranks)", {"dp_size": MAX_DP}),
        (f"autoscaled [1, {MAX_DP}]", {"dp_size": 1, "autoscaling": SCALING}),
    ]
    results = []
    for name, fields in systems:
        log(f"autoscale: {name}, {len(arrivals)} requests over {arrivals[-1]:.0f}s")
        try:
            results.append(_run(name, fields, arrivals))
        except Exception as exc:
            results.append(AutoscaleResult(name, error=repr(exc)))
    return results


def _run(name: str, fields: dict[str, Any], arrivals: list[float]) -> AutoscaleResult:
    kwargs = {"max_running": MAX_RUNNING, "step_delay_s": STEP_S}
    cluster = raydp.launch(name="autobench", backend="mp", progress=False, engine_kwargs=kwargs, **fields)
    result = AutoscaleResult(name)
    try:
        client = cluster.client()
        stop = threading.Event()
        sizes: list[int] = []
        sampler = threading.Thread(target=_sample, args=(cluster, stop, sizes), daemon=True)
        sampler.start()
        with ThreadPoolExecutor(max_workers=64) as pool:
            started = time.monotonic()
            futures = []
            for at in arrivals:
                time.sleep(max(0.0, started + at - time.monotonic()))
                futures.append(pool.submit(_one, client, started + at))
            outcomes = [f.result() for f in futures]
        stop.set()
        sampler.join()
    finally:
        cluster.close()
    result.latencies = sorted(o for o in outcomes if o is not None)
    result.requests, result.errors = len(outcomes), sum(o is None for o in outcomes)
    if result.latencies:
        result.p50_ms = 1000 * statistics.median(result.latencies)
        result.p99_ms = 1000 * result.latencies[min(len(result.latencies) - 1, int(0.99 * len(result.latencies)))]
    result.rank_seconds = SAMPLE_S * sum(sizes)
    result.peak = max(sizes, default=0)
    return result


def _one(client: raydp.Client, scheduled: float) -> float | None:
    try:
        tokens = client.generate([1], max_tokens=TOKENS, timeout=120)
    except raydp.RaydpError:
        return None
    return time.monotonic() - scheduled if len(tokens) == TOKENS else None


def _sample(cluster: raydp.Cluster, stop: threading.Event, sizes: list[int]) -> None:
    while not stop.wait(SAMPLE_S):
        sizes.append(cluster.dp_size)


def autoscale_table(results: list[AutoscaleResult], step: Step) -> list[str]:
    lines = [
        f"step load: {step.low:g} req/s for {step.before:g}s, {step.high:g} for {step.during:g}s, {step.low:g} for "
        f"{step.after:g}s (Poisson); a rank serves ~{MAX_RUNNING / (TOKENS * STEP_S):g} req/s",
        "| system | requests | errors | p50 (ms) | p99 (ms) | peak ranks | rank-seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.system} | error: {r.error} | | | | | |")
            continue
        lines.append(
            f"| {r.system} | {r.requests} | {r.errors} | {r.p50_ms:,.0f} | {r.p99_ms:,.0f} | {r.peak} | "
            f"{r.rank_seconds:,.0f} |"
        )
    verdict = _verdict(results)
    if verdict:
        lines.append(verdict)
    return lines


def _verdict(results: list[AutoscaleResult]) -> str:
    by = {r.system.split(" (")[0].split(" [")[0]: r for r in results if not r.error}
    auto, top = by.get("autoscaled"), by.get("fixed maximum")
    if auto is None or top is None or not top.p99_ms or not top.rank_seconds:
        return ""
    p99, cost = auto.p99_ms / top.p99_ms, auto.rank_seconds / top.rank_seconds
    ok = p99 <= P99_TARGET and cost <= RANK_SECONDS_TARGET
    return (
        f"autoscaled against the fixed maximum: p99 {p99:.2f}x (target <= {P99_TARGET}), rank-seconds "
        f"{cost:.2f}x (target <= {RANK_SECONDS_TARGET}): {'met' if ok else 'NOT met'}"
    )


def autoscale_failed(results: list[AutoscaleResult]) -> bool:
    return any(r.error or r.errors for r in results)


if __name__ == "__main__":
    import sys

    chosen = STEP_QUICK if "--quick" in sys.argv else STEP_FULL
    print("\n".join(autoscale_table(autoscale_benchmark(chosen), chosen)))
