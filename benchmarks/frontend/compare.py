"""The HTTP front-end benchmark: raydp's API servers against a Ray Serve HTTP deployment.

A third row serves the same load through vLLM's own OpenAI front-end (what
``raydp serve --engine vllm`` runs) over an engine that answers at once
(:class:`~raydp.models.vllm.instant.InstantVllmEngine`): raydp's own server
against vLLM's, with no engine cost in either.

Both systems serve OpenAI's ``POST /v1/completions`` over loopback with the
same engine, :class:`~raydp.models.echo.EchoEngine` (``max_tokens`` tokens,
one per step), and the same number of engine replicas:

* raydp: a DP=2 cluster on the Ray backend (its ranks are Ray actors, like
  Serve's replicas) with ``cluster.serve_api(4)``: 4 API server processes
  sharing one socket;
* Ray Serve: 2 replicas of :class:`EchoCompletions` behind Serve's HTTP
  proxy. Each replica runs an EchoEngine step loop in its own event loop (no
  extra hop between the HTTP handler and the engine) and answers in the same
  shapes as raydp: a ``text_completion`` object, or with ``"stream": true``
  one server-sent event per token, a last event with the ``finish_reason``,
  then ``data: [DONE]``. Access logs are off and ``max_ongoing_requests``
  admits the whole load, so Serve's defaults do not cap it.

A separate load-generator process (its own GIL; aiohttp, uvloop when
installed) keeps a fixed number of requests in flight for a fixed time,
non-streaming then streaming, and reports requests/s, p50/p99 latency and,
streaming, the time to the first ``data:`` event (TTFT). Every response is
checked: status 200 and ``max_tokens`` tokens back; anything else counts as an
error, not as throughput.

:func:`http_benchmark` runs it all; :func:`http_table` renders the results.
``python -m benchmarks`` calls both (``--only http`` runs this section alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks.common import DP_SIZE, ECHO_ENGINE, PROMPT, quiet_serve_logs
from benchmarks.frontend.load import (
    MODEL,
    HttpSizes,
    LoadStats,
    run_load,
    wait_ready,
)

API_SERVERS = 4
ROUTE = "/v1/completions"
# Targets from the issue: raydp / Ray Serve.
THROUGHPUT_TARGET = 5.0  # at least
TTFT_TARGET = 0.5  # at most

Log = Callable[[str], None]


@dataclass
class HttpResult:
    """One system: its setup time and both phases (``None`` if it failed before them)."""

    system: str
    setup_s: float = 0.0
    plain: LoadStats | None = None
    stream: LoadStats | None = None
    error: str | None = None


# ---- raydp ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def raydp_http() -> Iterator[str]:
    """A DP=2 EchoEngine cluster (Ray backend) with 4 API servers; yields the completions URL."""
    import raydp

    # The API servers serve the model id of the cluster's name: the body's MODEL.
    cluster = raydp.launch(name=MODEL, dp_size=DP_SIZE, engine=ECHO_ENGINE, progress=False)
    try:
        servers = cluster.serve_api(API_SERVERS, port=0)
        yield servers.url + ROUTE
    finally:
        cluster.close()


@contextlib.contextmanager
def raydp_vllm_frontend_http() -> Iterator[str]:
    """The same cluster, with vLLM's own front-end in the API servers, over an engine that answers at once
    (:class:`~raydp.models.vllm.instant.InstantVllmEngine`): the new front-end alone against the old."""
    import raydp
    from raydp.models.checkpoint import default_model_dir, make_model
    from raydp.serve.settings import ServerSettings

    model = str(make_model(default_model_dir()))  # its tokenizer and config; no weights are loaded
    settings = ServerSettings(vllm_args=("--model", model, "--served-model-name", MODEL, "--disable-log-stats"))
    cluster = raydp.launch(
        name=MODEL, dp_size=DP_SIZE, engine="raydp.models.vllm.instant:InstantVllmEngine", progress=False
    )
    try:
        servers = cluster.serve_api(API_SERVERS, port=0, settings=settings)
        yield servers.url + ROUTE
    finally:
        cluster.close()


# ---- Ray Serve --------------------------------------------------------------------------------------


class EchoCompletions:
    """A Ray Serve replica: ``POST /v1/completions`` over its own EchoEngine step loop.

    Requests join the engine as they arrive; one asyncio task steps it while
    anything is unfinished (yielding to the handlers after every step) and
    routes each output to its request's queue, as raydp's engine loop and API
    server do across processes.
    """

    def __init__(self) -> None:
        from raydp.engine.core import EngineContext
        from raydp.models.echo import EchoEngine

        self.engine = EchoEngine(EngineContext(rank=0, local_rank=0, dp_size=1, world_size=1, node_id=""))
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.work: asyncio.Event | None = None
        self.stepper: asyncio.Task[None] | None = None
        self.next_id = 0

    async def __call__(self, request: Any) -> Any:
        import msgspec
        from starlette.responses import Response, StreamingResponse

        if request.method != "POST" or request.url.path != ROUTE:
            return Response(status_code=404)
        body = msgspec.json.decode(await request.body())
        prompt = body["prompt"]
        prompt = list(prompt.encode()) if isinstance(prompt, str) else prompt
        max_tokens = int(body.get("max_tokens", 16))
        self.next_id += 1
        shape = {
            "id": f"cmpl-{id(self):x}-{self.next_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or MODEL,
        }
        outputs = self.generate(f"r{self.next_id}", prompt, max_tokens)
        if body.get("stream", False):
            return StreamingResponse(self.events(shape, outputs), media_type="text/event-stream")
        tokens: list[int] = []
        reason = None
        async for out in outputs:
            tokens += out.token_ids
            reason = out.finish_reason
        answer = completion(shape, tokens, reason)
        answer["usage"] = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt) + len(tokens),
        }
        return Response(msgspec.json.encode(answer), media_type="application/json")

    async def events(self, shape: dict[str, Any], outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        import msgspec

        reason = None
        async for out in outputs:
            if out.token_ids:
                yield b"data: " + msgspec.json.encode(completion(shape, out.token_ids, None)) + b"\n\n"
            reason = out.finish_reason
        yield b"data: " + msgspec.json.encode(completion(shape, [], reason)) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def generate(self, request_id: str, prompt: list[int], max_tokens: int) -> AsyncIterator[Any]:
        """The request's engine outputs as the step loop produces them; aborted if left early."""
        from raydp.wire.protocol import Request

        if self.stepper is None:
            self.work = asyncio.Event()
            self.stepper = asyncio.get_running_loop().create_task(self.step_loop())
        assert self.work is not None
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[request_id] = queue
        self.engine.add_request(Request(request_id, prompt, max_tokens))
        self.work.set()
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            if self.queues.pop(request_id, None) is not None:
                self.engine.abort([request_id])

    async def step_loop(self) -> None:
        assert self.work is not None
        while True:
            if not self.engine.has_unfinished():
                self.work.clear()
                await self.work.wait()
            for out in self.engine.step():
                queue = self.queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        del self.queues[out.request_id]
            await asyncio.sleep(0)


def completion(shape: dict[str, Any], tokens: list[int], finish_reason: str | None) -> dict[str, Any]:
    """An OpenAI ``text_completion`` object (or chunk), with ``token_ids`` as raydp adds it."""
    text = bytes(t if 0 <= t < 256 else 0xFF for t in tokens).decode("utf-8", errors="replace")
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason, "token_ids": tokens}
    return {**shape, "choices": [choice]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def serve_http(sizes: HttpSizes) -> Iterator[str]:
    """2 EchoCompletions replicas behind Serve's HTTP proxy on a free loopback port; yields the URL."""
    import ray.cloudpickle
    from ray import serve
    from ray.serve.schema import LoggingConfig

    # Replicas cannot import this script's module: ship the class by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    port = free_port()
    quiet = LoggingConfig(enable_access_log=False, log_level="WARNING")
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
    quiet_serve_logs()
    try:
        deployment = serve.deployment(
            EchoCompletions,
            name="bench-http-echo",
            num_replicas=DP_SIZE,
            ray_actor_options={"num_cpus": 0.5},
            max_ongoing_requests=sizes.concurrency,  # each replica may take the whole load, as a raydp rank can
            logging_config=quiet,
            graceful_shutdown_wait_loop_s=0.1,
            graceful_shutdown_timeout_s=1.0,
        )
        serve.run(deployment.bind(), name="bench-http", route_prefix="/")
        quiet_serve_logs()
        yield f"http://127.0.0.1:{port}{ROUTE}"
    finally:
        serve.shutdown()


# ---- the benchmark and its table --------------------------------------------------------------------


def measure_system(
    system: str, make: Callable[[], contextlib.AbstractContextManager[str]], sizes: HttpSizes, log: Log
) -> HttpResult:
    """Start ``system``, load it, stop it: one :class:`HttpResult`, with the error if anything failed."""
    result = HttpResult(system)
    start = time.perf_counter()
    try:
        with make() as url:
            wait_ready(url)
            result.setup_s = time.perf_counter() - start
            log(f"http: {system} at {url}, load for 2 x {sizes.warmup_s:g}+{sizes.duration_s:g} s")
            phases = run_load(url, sizes)
            result.plain, result.stream = phases["plain"], phases["stream"]
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def http_benchmark(sizes: HttpSizes, log: Log) -> list[HttpResult]:
    """raydp first, then Ray Serve; needs a running local Ray (``ray.init``)."""
    systems: list[tuple[str, Callable[[], contextlib.AbstractContextManager[str]], HttpSizes]] = [
        (f"raydp (DP={DP_SIZE}, {API_SERVERS} API servers)", raydp_http, sizes),
        (f"Ray Serve ({DP_SIZE} replicas, HTTP proxy)", lambda: serve_http(sizes), sizes),
        (
            f"raydp with vLLM's front-end (DP={DP_SIZE}, {API_SERVERS} API servers, an instant vLLM-native engine)",
            raydp_vllm_frontend_http,
            dataclasses.replace(sizes, return_token_ids=True),
        ),
    ]
    results = []
    for system, make, load in systems:
        log(f"http: starting {system}")
        results.append(measure_system(system, make, load, log))
    return results


def http_failed(results: list[HttpResult]) -> bool:
    """A system that did not run, or any request answered wrongly."""
    return any(r.error or r.plain is None or r.stream is None or r.plain.errors or r.stream.errors for r in results)


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value else "n/a"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _verdict(value: float | None, target: float) -> str:
    """``target`` above 1 is a floor (throughput), below 1 a ceiling (TTFT)."""
    if value is None:
        return "n/a"
    return "yes" if (value >= target if target > 1 else value <= target) else "NO"


def http_table(results: list[HttpResult], sizes: HttpSizes) -> list[str]:
    lines = [
        f"### HTTP front-end (POST {ROUTE}, {sizes.concurrency} connections, "
        f"prompt of {len(PROMPT)} tokens, max_tokens={sizes.max_tokens})",
        "",
        f"Each phase: {sizes.duration_s:g} s of closed-loop load after {sizes.warmup_s:g} s of warm-up, "
        "from a separate load-generator process (aiohttp). Latencies in ms; TTFT is the time to the first "
        "`data:` event.",
        "",
        "| system | req/s | p50 | p99 | stream req/s | TTFT p50 | TTFT p99 | stream p50 | stream p99 | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error is not None or r.plain is None or r.stream is None:
            lines.append(f"| {r.system} | failed: {r.error} | | | | | | | | |")
            continue
        p, s = r.plain, r.stream
        errors = p.errors + s.errors
        first = p.first_error or s.first_error
        lines.append(
            f"| {r.system} | {p.rps:,.0f} | {_ms(p.p50_ms)} | {_ms(p.p99_ms)} | {s.rps:,.0f} "
            f"| {_ms(s.ttft_p50_ms)} | {_ms(s.ttft_p99_ms)} | {_ms(s.p50_ms)} | {_ms(s.p99_ms)} "
            f"| {errors}{f' ({first})' if first else ''} |"
        )
    lines += ["", *ratio_table(results), *frontend_line(results)]
    return lines


def frontend_line(results: list[HttpResult]) -> list[str]:
    """vLLM's front-end (the third row) against raydp's own server (the first), both over instant engines."""
    if len(results) < 3:
        return []
    own, vllm = results[0], results[2]
    if own.plain is None or own.stream is None or vllm.plain is None or vllm.stream is None:
        return ["", "(no front-end ratio: a system did not run)"]
    plain, stream = _ratio(vllm.plain.rps, own.plain.rps), _ratio(vllm.stream.rps, own.stream.rps)
    shown = [f"{v:.2f}x" if v is not None else "n/a" for v in (plain, stream)]
    return ["", f"vLLM's front-end / raydp's own server: {shown[0]} req/s non-streaming, {shown[1]} streaming"]


def ratio_table(results: list[HttpResult]) -> list[str]:
    """raydp / Ray Serve for each number, with the issue's targets marked."""
    ours, theirs = (results + [HttpResult("missing")] * 2)[:2]
    if ours.plain is None or ours.stream is None or theirs.plain is None or theirs.stream is None:
        return ["(no ratios: a system did not run)"]
    op, os_, tp, ts = ours.plain, ours.stream, theirs.plain, theirs.stream
    rows: list[tuple[str, float | None, float | None]] = [
        ("throughput, non-streaming", _ratio(op.rps, tp.rps), THROUGHPUT_TARGET),
        ("throughput, streaming", _ratio(os_.rps, ts.rps), THROUGHPUT_TARGET),
        ("TTFT p50", _ratio(os_.ttft_p50_ms, ts.ttft_p50_ms), TTFT_TARGET),
        ("TTFT p99", _ratio(os_.ttft_p99_ms, ts.ttft_p99_ms), TTFT_TARGET),
        ("latency p50, non-streaming", _ratio(op.p50_ms, tp.p50_ms), None),
        ("latency p99, non-streaming", _ratio(op.p99_ms, tp.p99_ms), None),
        ("latency p50, streaming", _ratio(os_.p50_ms, ts.p50_ms), None),
    ]
    lines = ["| raydp / Ray Serve | ratio | target | met |", "|---|---:|---|---|"]
    for name, value, target in rows:
        shown = "n/a" if value is None else f"{value:.2f}x"
        if target is None:
            lines.append(f"| {name} | {shown} | | |")
        else:
            bound = f">= {target:g}x" if target > 1 else f"<= {target:g}x"
            lines.append(f"| {name} | **{shown}** | {bound} | {_verdict(value, target)} |")
    return lines
