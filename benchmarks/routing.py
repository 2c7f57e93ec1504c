"""Routing under skew: raydp's balancer against round robin and power-of-two choices, in one run.

A DP=4 cluster of ``EchoEngine`` ranks that each run at most ``MAX_RUNNING``
requests at a time (the rest wait) with ``STEP_S`` per step, so a long request
holds a slot for a long time. Open-loop (Poisson) arrivals come from 2 API
server processes over HTTP (2/3 of the rate) and from one driver client (1/3);
every source uses the policy under test. Two workloads per policy:

* skewed: 90% short requests (``SHORT`` tokens) and 10% long ones (``LONG``);
* uniform: short requests only (the ranks' shares should be even).

Latency is from a request's scheduled arrival to its last token, so queueing
behind a busy rank counts.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from urllib.parse import urlsplit

from benchmarks.common import log

POLICIES = ("least-loaded", "power-of-two", "round-robin")
RAYDP_POLICY = "least-loaded"
DP = 4
MAX_RUNNING, STEP_S = 2, 0.01
SHORT, LONG, LONG_SHARE = 4, 64, 0.1
HTTP_SHARE = 2 / 3
SHARE_TOLERANCE = 0.05


@dataclass(frozen=True)
class RoutingSizes:
    seconds: float  # arrivals per policy, uniform workload
    skewed_seconds: float  # and skewed: its p99 is the tail of 10% long requests, which needs samples
    skewed_rate: float  # requests per second, all sources together
    uniform_rate: float


# 20 s of the skewed workload hold ~100 long requests: its p99 rests on the slowest ten,
# and the policies' order flipped from run to run; 60 s triples that.
ROUTING_FULL = RoutingSizes(seconds=20.0, skewed_seconds=60.0, skewed_rate=50.0, uniform_rate=120.0)
ROUTING_QUICK = RoutingSizes(seconds=5.0, skewed_seconds=5.0, skewed_rate=50.0, uniform_rate=120.0)


@dataclass
class RoutingResult:
    policy: str
    workload: str
    requests: int = 0
    errors: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    shares: list[float] = field(default_factory=list)  # per rank, of all requests
    error: str = ""


class _Tally:
    """Latencies and serving ranks, from every sender thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.ranks: list[int] = []
        self.errors = 0

    def add(self, scheduled: float, rank: int | None) -> None:
        with self.lock:
            if rank is None:
                self.errors += 1
                return
            self.latencies.append(time.monotonic() - scheduled)
            self.ranks.append(rank)


def _http_sender(url: str, model: str) -> Callable[[int], int | None]:
    parts = urlsplit(url)
    local = threading.local()

    def send(max_tokens: int) -> int | None:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
        body = json.dumps({"model": model, "prompt": [5], "max_tokens": max_tokens})
        try:
            local.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            reply = local.conn.getresponse()
            data = json.loads(reply.read())
        except (OSError, http.client.HTTPException, ValueError):
            del local.conn
            return None
        return int(data["choices"][0]["rank"]) if reply.status == 200 else None

    return send


def _driver_sender(client: object) -> Callable[[int], int | None]:
    def send(max_tokens: int) -> int | None:
        handle = client.submit([5], max_tokens)  # type: ignore[attr-defined]
        try:
            handle.result(60)
        except Exception:
            return None
        return int(handle.rank)

    return send


def _send_one(tally: _Tally, send: Callable[[int], int | None], scheduled: float, tokens: int) -> None:
    tally.add(scheduled, send(tokens))


def _open_loop(
    send: Callable[[int], int | None], rate: float, seconds: float, long_share: float, tally: _Tally, seed: int
) -> None:
    """Poisson arrivals at ``rate`` for ``seconds``; each request runs on a pool thread."""
    rng = random.Random(seed)
    with ThreadPoolExecutor(max_workers=48) as pool:
        at = time.monotonic()
        end = at + seconds
        while at < end:
            at += rng.expovariate(rate)
            time.sleep(max(0.0, at - time.monotonic()))
            tokens = LONG if rng.random() < long_share else SHORT
            pool.submit(partial(_send_one, tally, send, at, tokens))


def _run(policy: str, workload: str, sizes: RoutingSizes) -> RoutingResult:
    import raydp
    from raydp.serve.settings import ServerSettings

    rate, long_share, seconds = (
        (sizes.skewed_rate, LONG_SHARE, sizes.skewed_seconds)
        if workload == "skewed"
        else (sizes.uniform_rate, 0.0, sizes.seconds)
    )
    name = f"bench-route-{policy}"
    tally = _Tally()
    with raydp.launch(
        name=name, dp_size=DP, progress=False, engine_kwargs={"max_running": MAX_RUNNING, "step_delay_s": STEP_S}
    ) as cluster:
        servers = cluster.serve_api(2, settings=ServerSettings(balancer=policy))  # type: ignore[arg-type]
        client = cluster.client(balancer=policy)  # type: ignore[arg-type]
        senders = [
            (_http_sender(servers.url, name), rate * HTTP_SHARE),
            (_driver_sender(client), rate * (1 - HTTP_SHARE)),
        ]
        threads = [
            threading.Thread(target=_open_loop, args=(send, r, seconds, long_share, tally, i))
            for i, (send, r) in enumerate(senders)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    cuts = statistics.quantiles(tally.latencies, n=100) if len(tally.latencies) > 1 else [0.0] * 99
    shares = [tally.ranks.count(r) / max(1, len(tally.ranks)) for r in range(DP)]
    return RoutingResult(
        policy,
        workload,
        len(tally.latencies),
        tally.errors,
        statistics.median(tally.latencies) * 1e3 if tally.latencies else 0.0,
        cuts[98] * 1e3,
        shares,
    )


def routing_benchmark(sizes: RoutingSizes) -> list[RoutingResult]:
    results = []
    for workload in ("skewed", "uniform"):
        for policy in POLICIES:
            log(f"routing: {policy}, {workload}")
            try:
                results.append(_run(policy, workload, sizes))
            except Exception as exc:
                results.append(RoutingResult(policy, workload, error=repr(exc)[:200]))
    return results


def routing_failed(results: list[RoutingResult]) -> bool:
    return any(r.error or r.errors for r in results)


def routing_table(results: list[RoutingResult], sizes: RoutingSizes) -> list[str]:
    lines = [
        "### Routing under skew (DP=4; 2 API server processes over HTTP + 1 driver client)",
        "",
        f"Open-loop arrivals: skewed = {sizes.skewed_seconds:g} s of {sizes.skewed_rate:g} req/s, "
        f"{1 - LONG_SHARE:.0%} of {SHORT} tokens and {LONG_SHARE:.0%} of {LONG}; uniform = "
        f"{sizes.seconds:g} s of {sizes.uniform_rate:g} req/s of {SHORT} tokens. "
        f"Every policy gets the same arrivals. Each rank runs {MAX_RUNNING} requests at a time, "
        f"{STEP_S * 1e3:g} ms per step.",
        "",
        "| workload | policy | requests | errors | p50 ms | p99 ms | rank shares |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.workload} | {r.policy} | failed: {r.error} | | | | |")
            continue
        shares = " / ".join(f"{s:.0%}" for s in r.shares)
        lines.append(
            f"| {r.workload} | {r.policy} | {r.requests} | {r.errors} | {r.p50_ms:.0f} | {r.p99_ms:.0f} | {shares} |"
        )
    return lines + _verdicts(results)


def _verdicts(results: list[RoutingResult]) -> list[str]:
    ok = {(r.workload, r.policy): r for r in results if not r.error}
    ours, others = ok.get(("skewed", RAYDP_POLICY)), [ok.get(("skewed", p)) for p in POLICIES[1:]]
    lines = [""]
    if ours and all(others):
        best = min(o.p99_ms for o in others if o)
        lines.append(
            f"Skewed p99: raydp {ours.p99_ms:.0f} ms against the better alternative's {best:.0f} ms "
            f"({'met' if ours.p99_ms <= best else 'missed'}: raydp <= min(round robin, power of two))."
        )
    uniform = ok.get(("uniform", RAYDP_POLICY))
    if uniform:
        worst = max(abs(s - 1 / DP) for s in uniform.shares)
        lines.append(
            f"Uniform shares: at most {worst:.1%} from an even {1 / DP:.0%} "
            f"({'met' if worst <= SHARE_TOLERANCE else 'missed'}: within ±{SHARE_TOLERANCE:.0%})."
        )
    return lines
