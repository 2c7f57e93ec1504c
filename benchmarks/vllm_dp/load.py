"""The load generator of :mod:`benchmarks.vllm_dp`: streamed completions in a closed loop, one client for both systems.

Per request (:class:`Sample`): the time to the first chunk that carries
tokens, the inter-token gaps (a chunk's gap split evenly over its tokens:
``choices[0].token_ids`` where the server sends them, else one token a
chunk), the end-to-end latency, the output tokens (the usage chunk's
``completion_tokens``) and the serving rank (raydp's choices name it).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.common import log
from benchmarks.vllm_dp.servers import Server, ServerError

FIRST_TOKEN_ID = 3  # 0-2 are bos, eos and pad in make_model's vocabulary


@dataclass
class Sample:
    """One request as the client saw it; times on the monotonic clock, in seconds."""

    start: float
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    rank: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.end > 0 and self.error is None and self.ttft is not None


def completion_body(prompt: list[int], max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_tokens(chunk: dict[str, Any]) -> int:
    """Tokens in one chunk: its ``token_ids`` when sent (raydp), else one (vLLM streams a step's token a chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0  # the usage chunk
    ids = choices[0].get("token_ids")
    return len(ids) if isinstance(ids, list) else 1


async def read_stream(resp: aiohttp.ClientResponse, sample: Sample) -> None:
    last, counted, usage, done = sample.start, 0, None, False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            sample.error = f"stream error: {json.dumps(chunk['error'])[:160]}"
            return
        usage = chunk.get("usage") or usage
        k, now = chunk_tokens(chunk), time.monotonic()
        if k == 0:
            continue
        if sample.ttft is None:
            sample.ttft = now - sample.start
        else:
            sample.itl.extend([(now - last) / k] * k)
        last, counted = now, counted + k
        sample.rank = chunk["choices"][0].get("rank", sample.rank)
    if not done:
        sample.error = "stream ended without [DONE]"
    sample.tokens = int(usage["completion_tokens"]) if usage else counted


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], sample: Sample, timeout_s: float
) -> None:
    """Fill ``sample`` from one streamed completion; every failure becomes its ``error``."""
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}: {(await resp.text())[:160]}"
            else:
                await read_stream(resp, sample)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:200]
    sample.end = time.monotonic()


def client_session(concurrency: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4))


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)] for _ in range(n)]


async def closed_loop(
    server: Server, prompts: list[list[int]], max_tokens: int, concurrency: int, timeout_s: float
) -> tuple[list[Sample], float]:
    """Each prompt once, ``concurrency`` in flight; the samples and the wall time."""
    todo: Iterator[list[int]] = iter(prompts)  # shared by the workers: each takes the next prompt
    samples: list[Sample] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        for prompt in todo:
            sample = Sample(time.monotonic())
            samples.append(sample)
            await stream_completion(
                session, server.url, completion_body(prompt, max_tokens, server.ignore_eos), sample, timeout_s
            )

    async with client_session(concurrency) as session:
        start = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return samples, time.monotonic() - start


async def probe(session: aiohttp.ClientSession, server: Server) -> bool:
    """One tiny completion; a 400 naming ``ignore_eos`` drops the field (a server without it yet)."""
    body = {"prompt": [FIRST_TOKEN_ID, 4, 5], "max_tokens": 1}
    if server.ignore_eos:
        body["ignore_eos"] = True
    try:
        async with session.post(
            f"{server.url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)
        ) as resp:
            text = await resp.text()
            if resp.status == 400 and "ignore_eos" in text and server.ignore_eos:
                log(f"{server.system}: ignore_eos refused ({text[:120]}); measuring without it")
                server.ignore_eos = False
            return resp.status == 200 and '"choices"' in text
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def last_error(log_text: str) -> str:
    """The last ``SomeError: message`` line of a log (what a traceback ends with), else its tail."""
    errors = [line.strip() for line in log_text.splitlines() if re.match(r"\s*[\w.]+(Error|Exception): ", line)]
    return errors[-1][:300] if errors else log_text[-300:]


# A server that logs one of these will never serve: say so at once rather than after the startup timeout.
NEVER_SERVES = ("No available node types can fulfill resource request",)


async def wait_ready(server: Server, timeout_s: float) -> float:
    """Seconds from the spawn to the first successful completion."""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - server.spawned < timeout_s:
            if server.proc.poll() is not None:
                raise ServerError(
                    f"{server.system} exited ({server.proc.returncode}) before serving: {last_error(server.log_tail())}"
                )
            log_text = server.log_tail(20000)
            if (
                line := next((x for x in log_text.splitlines() if any(n in x for n in NEVER_SERVES)), None)
            ) is not None:
                plain = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()  # Ray colours its log prefixes
                raise ServerError(f"{server.system} cannot start: {plain[-300:]}")
            if await probe(session, server):
                startup = time.monotonic() - server.spawned
                log(f"{server.system}: serving after {startup:.1f} s")
                return startup
            await asyncio.sleep(0.5)
    raise ServerError(f"{server.system} did not serve within {timeout_s:g} s: {server.log_tail()}")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


async def _metrics(url: str) -> str:
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as answer,
        ):
            return await answer.text()
    except (aiohttp.ClientError, TimeoutError):
        return ""


async def hangs_counted(url: str) -> float:
    """The hangs raydp's API server counted (``raydp_rank_hangs_total``, summed over ranks)."""
    text = await _metrics(url)
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith("raydp_rank_hangs_total{"))


async def all_ranks_live(url: str) -> bool:
    """Whether raydp's API server reports every rank live (no ``raydp_rank_dead{...} 1``)."""
    text = await _metrics(url)
    dead = [x for x in text.splitlines() if x.startswith("raydp_rank_dead{")]
    return bool(dead) and all(float(x.split()[-1]) == 0.0 for x in dead)


async def rank_live(url: str, rank: int) -> bool:
    """Whether raydp's API server reports ``rank`` live (``raydp_rank_dead{rank=...} 0`` on its /metrics)."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as answer,
        ):
            text = await answer.text()
    except (aiohttp.ClientError, TimeoutError):
        return False
    line = next((x for x in text.splitlines() if x.startswith(f'raydp_rank_dead{{rank="{rank}"}}')), None)
    return line is not None and float(line.split()[-1]) == 0.0
