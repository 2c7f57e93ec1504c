"""Prefix-cache-aware routing on vLLM engines: ``prefix`` against the load-only policies and an oracle, in one run.

One DP=2 cluster (``mp`` backend) of :class:`~raydp.models.vllm.VllmEngine`
ranks with vLLM's prefix caching serves every policy in turn, each from a
fresh client after both ranks' caches were reset. The workload is a shared
system prompt per conversation: ``PREFIXES`` prefixes of ``PREFIX_LEN``
random token ids, each request one of them (seeded random order) plus a short
unique suffix, ``MAX_TOKENS`` tokens out, a closed loop of ``CONCURRENCY``
requests in flight. Each rank's KV cache holds about ``CACHE_PREFIXES`` of
the prefixes: enough for half of them, not for all, which is what makes
routing matter (with room for everything, every policy ends up with every
prefix on every rank).

Compared: ``prefix`` (raydp's cache-aware policy), ``least-loaded``,
``power-of-two``, ``round-robin``, and an oracle that pins prefix ``i`` to
rank ``i % 2``. Reported per policy: vLLM's prefix-cache hit rate (prompt
tokens found cached, from the ranks' own counts), TTFT p50/p99 (submission to
first token), throughput, and each rank's share of requests. Targets: the
hit rate at least 0.9x the oracle's, TTFT p50 at most 0.7x least-loaded's,
and each rank's share within 15% of an even split.

The model is the vLLM bench's small Llama (``benchmarks.vllm_dp``), so
prefill is most of a request's time at these prompt lengths.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import raydp
from benchmarks.common import log
from raydp.client.balancer import Policy

POLICIES = ("prefix", "least-loaded", "power-of-two", "round-robin", "oracle")
DP = 2
BLOCK = 32  # tokens per KV block (vLLM's CPU attention wants a multiple of 32)
HIT_TARGET, TTFT_TARGET, SHARE_TOLERANCE = 0.9, 0.7, 0.15


@dataclass(frozen=True)
class PrefixSizes:
    prefixes: int = 8
    prefix_len: int = 1000
    suffix_len: int = 16
    requests: int = 160
    concurrency: int = 4
    max_tokens: int = 4
    cache_prefixes: float = 5.0  # what one rank's KV cache holds, in prefixes
    seed: int = 0


PREFIX_FULL = PrefixSizes()
PREFIX_QUICK = PrefixSizes(requests=48)


@dataclass
class PrefixResult:
    policy: str
    requests: int = 0
    hit_rate: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    throughput: float = 0.0  # requests a second
    shares: list[float] = field(default_factory=list)
    error: str | None = None


def _workload(sizes: PrefixSizes, vocab: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(sizes.seed)
    heads = [[rng.randrange(1, vocab) for _ in range(sizes.prefix_len)] for _ in range(sizes.prefixes)]
    out = []
    for _ in range(sizes.requests):
        which = rng.randrange(sizes.prefixes)
        out.append((which, heads[which] + [rng.randrange(1, vocab) for _ in range(sizes.suffix_len)]))
    return out


def _engine_kwargs(model: str, sizes: PrefixSizes) -> dict[str, Any]:
    from benchmarks.vllm_dp.run import SIZES

    layers, hidden, _, _ = SIZES["tiny"]
    bytes_per_token = layers * 2 * hidden * 4  # K and V, float32, every head kept (no GQA)
    return {
        "model": model,
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 2048,
        "max_num_seqs": 16,
        "block_size": BLOCK,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": int(sizes.cache_prefixes * sizes.prefix_len * bytes_per_token),
    }


def _hits(cluster: raydp.Cluster) -> list[tuple[int, int]]:
    return [(q, h) for q, h in cluster.coordinator_state().prefix_cache] or [(0, 0)] * DP


def _run_policy(cluster: raydp.Cluster, policy: str, work: list[tuple[int, list[int]]], sizes: PrefixSizes) -> Any:
    balancer = cast(Policy, "least-loaded" if policy == "oracle" else policy)
    client = cluster.client(balancer=balancer)
    for rank in range(DP):
        client.call_utility(rank, "reset_prefix_cache")
    time.sleep(0.5)  # the clearing reaches every client's picture
    before = _hits(cluster)
    ttfts: list[float] = []
    ranks = [0] * DP
    lock = threading.Lock()
    queue = iter(work)

    def worker() -> None:
        while True:
            with lock:
                item = next(queue, None)
            if item is None:
                return
            which, prompt = item
            pinned = which % DP if policy == "oracle" else None
            start = time.perf_counter()
            handle = client.submit(prompt, sizes.max_tokens, rank=pinned, sampling=raydp.Sampling(ignore_eos=True))
            first = None
            for _ in handle.stream(timeout=120):
                if first is None:
                    first = time.perf_counter() - start
            with lock:
                ttfts.append(first or 0.0)
                ranks[handle.rank or 0] += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(sizes.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    time.sleep(0.5)  # the ranks' last hit counts reach the coordinator
    after = _hits(cluster)
    client.close()
    return ttfts, ranks, elapsed, before, after


def _result(policy: str, run: Any) -> PrefixResult:
    ttfts, ranks, elapsed, before, after = run
    queried = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ttfts = sorted(ttfts)
    total = sum(ranks)
    return PrefixResult(
        policy=policy,
        requests=total,
        hit_rate=hits / queried if queried else 0.0,
        ttft_p50_ms=1000 * statistics.median(ttfts),
        ttft_p99_ms=1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        throughput=total / elapsed,
        shares=[r / total for r in ranks],
    )


def prefix_benchmark(sizes: PrefixSizes) -> list[PrefixResult]:
    from benchmarks.vllm_dp.run import build_model

    model = build_model(None, "tiny")
    kwargs = _engine_kwargs(model, sizes)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    log(
        f"prefix: DP={DP} vLLM ranks, {sizes.prefixes} prefixes of {sizes.prefix_len} tokens, {sizes.requests} requests"
    )
    with raydp.launch(
        name="bench-prefix",
        dp_size=DP,
        backend="mp",
        engine="raydp.models.vllm:VllmEngine",
        engine_kwargs=kwargs,
        max_restarts=0,
        progress=False,
    ) as cluster:
        work = _workload(sizes, vocab)
        warm = cluster.client()
        for rank in range(DP):  # the first requests of an engine pay for its warm-up, not for routing
            warm.generate(work[0][1][:32], max_tokens=2, rank=rank)
        warm.close()
        results = []
        for policy in POLICIES:
            try:
                results.append(_result(policy, _run_policy(cluster, policy, work, sizes)))
            except Exception as exc:  # one policy's failure is reported, the others still run
                results.append(PrefixResult(policy, error=f"{type(exc).__name__}: {exc}"))
            log(f"prefix: {results[-1]}")
    return results


def prefix_failed(results: list[PrefixResult]) -> bool:
    return any(r.error for r in results)


def prefix_table(results: list[PrefixResult], sizes: PrefixSizes) -> list[str]:
    lines = [
        f"Prefix-cache-aware routing, vLLM engines (DP={DP}, {sizes.prefixes} prefixes x {sizes.prefix_len} "
        f"tokens, {sizes.requests} requests, {sizes.concurrency} in flight, cache ~{sizes.cache_prefixes:g} "
        "prefixes a rank)",
        "",
        "| policy | hit rate | TTFT p50 ms | TTFT p99 ms | req/s | rank shares |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.policy} | error: {r.error} | | | | |")
            continue
        shares = " / ".join(f"{100 * s:.0f}%" for s in r.shares)
        lines.append(
            f"| {r.policy} | {r.hit_rate:.2f} | {r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} | "
            f"{r.throughput:.1f} | {shares} |"
        )
    return [*lines, "", *_verdicts(results)]


def _verdicts(results: list[PrefixResult]) -> list[str]:
    by = {r.policy: r for r in results if not r.error}
    if not {"prefix", "oracle", "least-loaded"} <= set(by):
        return ["targets: not judged (a run failed)"]
    ours, oracle, least = by["prefix"], by["oracle"], by["least-loaded"]
    hit = ours.hit_rate / oracle.hit_rate if oracle.hit_rate else 0.0
    ttft = ours.ttft_p50_ms / least.ttft_p50_ms if least.ttft_p50_ms else float("inf")
    even = 1 / DP
    worst = max(abs(s - even) / even for s in ours.shares)
    return [
        f"hit rate {hit:.2f}x the oracle's (target >= {HIT_TARGET}): {'met' if hit >= HIT_TARGET else 'NOT met'}",
        f"TTFT p50 {ttft:.2f}x least-loaded's (target <= {TTFT_TARGET}): {'met' if ttft <= TTFT_TARGET else 'NOT met'}",
        f"rank shares within {100 * worst:.0f}% of even (target <= {100 * SHARE_TOLERANCE:.0f}%): "
        f"{'met' if worst <= SHARE_TOLERANCE else 'NOT met'}",
    ]


def main() -> None:
    import sys

    sizes = PREFIX_QUICK if "--quick" in sys.argv else PREFIX_FULL
    results = prefix_benchmark(sizes)
    print("\n".join(prefix_table(results, sizes)))


if __name__ == "__main__":
    main()
