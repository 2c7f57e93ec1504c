"""Adapter-aware routing against adapter-blind least-loaded and round robin, in one run.

DP=2 ``EchoEngine`` ranks (mp backend), each holding ``SLOTS`` LoRA adapters
at once (``max_loras``) and stalling ``LOAD_S`` per adapter load, as vLLM's
synchronous load stalls a step; ``MAX_RUNNING`` requests run at a time,
``STEP_S`` per step. ``ADAPTERS`` adapters with Zipf popularity (exponent
``ZIPF``); open-loop Poisson arrivals from one driver client, the same
arrivals for every policy, each on a fresh cluster (no adapter held at the
start). Per policy: adapter loads (swaps), time to first token from the
scheduled arrival (queueing counts), and completed requests per second.

What this measures is the routing: the engines hold adapter names, not
weights, and a load's cost is the set stall. With vLLM engines the same
policies route real adapters (``raydp serve --engine vllm --enable-lora``),
measured with ``vllm bench serve``'s LoRA options by :mod:`benchmarks.vllm_dp.loras`.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from benchmarks.common import log

POLICIES = ("adapter-aware", "least-loaded", "round-robin")
DP, SLOTS, ADAPTERS, ZIPF = 2, 2, 8, 1.1
MAX_RUNNING, STEP_S, LOAD_S, TOKENS = 8, 0.005, 0.05, 16
TARGETS = {"loads": 0.3, "ttft_p50": 0.8, "throughput": 1.0}  # adapter-aware over least-loaded


@dataclass(frozen=True)
class AdapterSizes:
    seconds: float
    rate: float  # requests per second


# 30 req/s: about half of what the two ranks serve with this adapter churn. At 60 both ranks saturate,
# queues form whatever the policy, and an engine that batches a loaded adapter's waiting requests hides
# the routing (measured in docs/benchmarks.md).
ADAPTERS_FULL = AdapterSizes(seconds=30.0, rate=30.0)
ADAPTERS_QUICK = AdapterSizes(seconds=10.0, rate=30.0)


@dataclass
class AdapterResult:
    policy: str
    requests: int = 0
    errors: int = 0
    loads: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    throughput: float = 0.0  # completed requests per second
    error: str = ""


@dataclass
class _Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    last_done: float = 0.0


def _arrivals(sizes: AdapterSizes, seed: int = 0) -> list[tuple[float, str]]:
    """``(offset s, adapter)`` of every request: Poisson in time, Zipf over the adapters."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** ZIPF for i in range(ADAPTERS)]
    out: list[tuple[float, str]] = []
    at = 0.0
    while True:
        at += rng.expovariate(sizes.rate)
        if at >= sizes.seconds:
            return out
        out.append((at, f"ad{rng.choices(range(ADAPTERS), weights)[0]}"))


def _one(client: object, tally: _Tally, due: float, adapter: str) -> None:
    try:
        handle = client.submit([1, 2, 3], TOKENS, adapter=adapter)  # type: ignore[attr-defined]
        first = None
        for _ in handle.stream(timeout=60):
            if first is None:
                first = time.monotonic()
        with tally.lock:
            tally.ttfts.append((first or time.monotonic()) - due)
            tally.last_done = max(tally.last_done, time.monotonic())
    except Exception:
        with tally.lock:
            tally.errors += 1


def _run(policy: str, sizes: AdapterSizes) -> AdapterResult:
    import raydp

    kwargs = {"max_running": MAX_RUNNING, "step_delay_s": STEP_S, "max_loras": SLOTS, "adapter_load_s": LOAD_S}
    tally, arrivals = _Tally(), _arrivals(sizes)
    with raydp.launch(
        name=f"bench-adapters-{policy}", dp_size=DP, backend="mp", progress=False, engine_kwargs=kwargs
    ) as cluster:
        client = cluster.client(
            balancer="round-robin" if policy == "round-robin" else "least-loaded",
            adapter_affinity=policy == "adapter-aware",
        )
        start = time.monotonic()
        with ThreadPoolExecutor(128) as pool:
            for offset, adapter in arrivals:
                due = start + offset
                time.sleep(max(0.0, due - time.monotonic()))
                pool.submit(_one, client, tally, due, adapter)
        time.sleep(0.5)  # the ranks' last reports reach the snapshot
        snap = client.snapshot()
        loads = sum(state.loads for state in snap.adapters) if snap is not None else 0
    done = len(tally.ttfts)
    cuts = statistics.quantiles(tally.ttfts, n=100) if done > 1 else [0.0] * 99
    took = max(tally.last_done - start, 1e-9)
    return AdapterResult(
        policy,
        done,
        tally.errors,
        loads,
        statistics.median(tally.ttfts) * 1e3 if done else 0.0,
        cuts[98] * 1e3,
        done / took,
    )


def adapters_benchmark(sizes: AdapterSizes) -> list[AdapterResult]:
    results = []
    for policy in POLICIES:
        log(f"adapters: {policy}")
        try:
            results.append(_run(policy, sizes))
        except Exception as exc:
            results.append(AdapterResult(policy, error=repr(exc)[:200]))
    return results


def adapters_failed(results: list[AdapterResult]) -> bool:
    return any(r.error or r.errors for r in results)


def adapters_table(results: list[AdapterResult], sizes: AdapterSizes) -> list[str]:
    lines = [
        f"### Adapter-aware routing (DP={DP}, {ADAPTERS} adapters, {SLOTS} slots per rank, Zipf {ZIPF})",
        "",
        f"Open-loop: {sizes.seconds:g} s of {sizes.rate:g} req/s from one driver client, {TOKENS} tokens each; "
        f"each rank runs {MAX_RUNNING} at a time, {STEP_S * 1e3:g} ms per step, and stalls "
        f"{LOAD_S * 1e3:g} ms per adapter load. Every policy gets the same arrivals, on a fresh cluster.",
        "",
        "| policy | requests | errors | adapter loads | TTFT p50 ms | TTFT p99 ms | req/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.policy} | failed: {r.error} | | | | | |")
            continue
        lines.append(
            f"| {r.policy} | {r.requests} | {r.errors} | {r.loads} | {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} "
            f"| {r.throughput:.1f} |"
        )
    return lines + _verdicts(results)


def _verdicts(results: list[AdapterResult]) -> list[str]:
    ok = {r.policy: r for r in results if not r.error}
    ours, blind = ok.get("adapter-aware"), ok.get("least-loaded")
    if ours is None or blind is None:
        return []
    ratios = {
        "loads": ours.loads / max(blind.loads, 1),
        "ttft_p50": ours.ttft_p50_ms / max(blind.ttft_p50_ms, 1e-9),
        "throughput": ours.throughput / max(blind.throughput, 1e-9),
    }
    met = {
        "loads": ratios["loads"] <= TARGETS["loads"],
        "ttft_p50": ratios["ttft_p50"] <= TARGETS["ttft_p50"],
        "throughput": ratios["throughput"] >= TARGETS["throughput"],
    }
    return [
        "",
        "Adapter-aware over least-loaded: "
        + "; ".join(
            f"{name} {ratios[name]:.2f}x ({'met' if met[name] else 'missed'}: "
            f"{'<=' if name != 'throughput' else '>='} {TARGETS[name]:g}x)"
            for name in ("loads", "ttft_p50", "throughput")
        )
        + ".",
    ]
