"""The HTTP load generator: a fixed number of completions in flight for a fixed time, in its own process.

It checks every answer (status 200, ``max_tokens`` tokens, ``[DONE]`` at the end of a stream) and
reports requests/s, p50/p99 latency and, streaming, the time to the first event (TTFT).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from benchmarks.common import PROMPT

MODEL = "bench-http"
READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HttpSizes:
    """The load: ``concurrency`` requests in flight, each phase ``duration_s`` after ``warmup_s``."""

    concurrency: int
    max_tokens: int
    warmup_s: float
    duration_s: float
    return_token_ids: bool = False  # vLLM's front-end sends the token ids only when asked


HTTP_FULL = HttpSizes(concurrency=64, max_tokens=16, warmup_s=2.0, duration_s=8.0)
HTTP_QUICK = HttpSizes(concurrency=64, max_tokens=16, warmup_s=0.5, duration_s=1.5)


@dataclass
class LoadStats:
    """One phase of load against one system; times in milliseconds."""

    requests: int = 0  # answered correctly inside the phase
    errors: int = 0
    elapsed_s: float = 0.0
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    ttft_p50_ms: float | None = None  # streaming only
    ttft_p99_ms: float | None = None
    first_error: str | None = None


def completion_body(stream: bool, max_tokens: int, return_token_ids: bool = False) -> bytes:
    """The one request body every system gets (vLLM's front-end asked for its token ids too)."""
    import json

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}
    if return_token_ids:
        body["return_token_ids"] = True
    return json.dumps(body).encode()


class BadAnswerError(Exception):
    """A response that is not a complete, correct completion."""


async def plain_request(session: Any, url: str, body: bytes, max_tokens: int) -> tuple[float, None]:
    """One non-streaming completion; its latency in seconds."""
    import msgspec

    start = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        data = await resp.read()
    latency = time.perf_counter() - start
    if resp.status != 200:
        raise BadAnswerError(f"HTTP {resp.status}: {data[:200]!r}")
    tokens = msgspec.json.decode(data)["choices"][0]["token_ids"]
    if len(tokens) != max_tokens:
        raise BadAnswerError(f"{len(tokens)} tokens, not {max_tokens}")
    return latency, None


async def stream_request(session: Any, url: str, body: bytes, max_tokens: int) -> tuple[float, float]:
    """One streaming completion; its latency and time to the first ``data:`` event, in seconds."""
    import msgspec

    start = time.perf_counter()
    first: float | None = None
    tokens, done = 0, False
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise BadAnswerError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if first is None:
                first = time.perf_counter() - start
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            tokens += len(msgspec.json.decode(payload)["choices"][0]["token_ids"])
    latency = time.perf_counter() - start
    if not done or tokens != max_tokens or first is None:
        raise BadAnswerError(f"stream ended after {tokens} of {max_tokens} tokens (done={done})")
    return latency, first


async def drive(url: str, stream: bool, sizes: HttpSizes, duration_s: float) -> LoadStats:
    """``sizes.concurrency`` connections, each sending requests back to back for ``duration_s``."""
    import aiohttp

    body = completion_body(stream, sizes.max_tokens, sizes.return_token_ids)
    send = stream_request if stream else plain_request
    latencies: list[float] = []
    ttfts: list[float] = []
    stats = LoadStats()

    async def worker(session: aiohttp.ClientSession, stop_at: float) -> None:
        while time.perf_counter() < stop_at:
            try:
                latency, ttft = await send(session, url, body, sizes.max_tokens)
            except (BadAnswerError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                stats.errors += 1
                stats.first_error = stats.first_error or f"{type(exc).__name__}: {exc}"
                continue
            latencies.append(latency)
            if ttft is not None:
                ttfts.append(ttft)

    connector = aiohttp.TCPConnector(limit=sizes.concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session, start + duration_s) for _ in range(sizes.concurrency)))
        stats.elapsed_s = time.perf_counter() - start
    return summarize(stats, latencies, ttfts)


def summarize(stats: LoadStats, latencies: list[float], ttfts: list[float]) -> LoadStats:
    stats.requests = len(latencies)
    stats.rps = len(latencies) / stats.elapsed_s if stats.elapsed_s else 0.0
    stats.p50_ms, stats.p99_ms = percentiles_ms(latencies)
    if ttfts:
        stats.ttft_p50_ms, stats.ttft_p99_ms = percentiles_ms(ttfts)
    return stats


def percentiles_ms(samples: list[float]) -> tuple[float, float]:
    if len(samples) < 2:
        return (samples[0] * 1e3, samples[0] * 1e3) if samples else (0.0, 0.0)
    return statistics.median(samples) * 1e3, statistics.quantiles(samples, n=100)[98] * 1e3


async def load_phases(url: str, sizes: HttpSizes) -> dict[str, LoadStats]:
    """Warm up, then non-streaming, then streaming (each phase warmed up again, untimed)."""
    results = {}
    for phase, stream in (("plain", False), ("stream", True)):
        await drive(url, stream, sizes, sizes.warmup_s)
        results[phase] = await drive(url, stream, sizes, sizes.duration_s)
    return results


def loadgen_main(url: str, sizes: HttpSizes, results: Any) -> None:
    """Body of the load-generator process: put ``load_phases``'s result (or the error's text) on ``results``."""
    try:
        try:
            import uvloop

            outcome: dict[str, LoadStats] | str = uvloop.run(load_phases(url, sizes))
        except ImportError:
            outcome = asyncio.run(load_phases(url, sizes))
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    results.put(outcome)


def run_load(url: str, sizes: HttpSizes) -> dict[str, LoadStats]:
    """Run :func:`loadgen_main` in a spawned process and wait for its numbers."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    proc = spawn.Process(target=loadgen_main, args=(url, sizes, results), name="bench-http-load", daemon=True)
    proc.start()
    budget = 2 * (sizes.warmup_s + sizes.duration_s) + 2 * REQUEST_TIMEOUT_S
    try:
        outcome: dict[str, LoadStats] | str = results.get(timeout=budget)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    if isinstance(outcome, str):
        raise RuntimeError(f"load generator failed: {outcome}")
    return outcome


def wait_ready(url: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Until one non-streaming completion comes back 200."""
    request = urllib.request.Request(url, data=completion_body(False, 1), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer 200 in {timeout}s (last: {exc})") from None
        time.sleep(0.2)
