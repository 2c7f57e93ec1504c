"""The round-trip benchmark's run and table: the ZeroMQ-class systems side by side, taking turns.

raydp (over IPC, TCP + CURVE and plain TCP), its ``submit_many`` and the two raw
ZeroMQ floors are open at once and take turns: each turn gives every one of
them a pipelined window and a slice of sequential requests, the order
rotating from turn to turn. The IPC, TCP + CURVE and ``submit_many`` rows are
three clients of one cluster (an engine binds a plain IPC input and a CURVE
TCP one; a client that is not on the engines' node takes TCP), so between
them only the path differs; plain TCP needs a cluster with ``auth="none"``.

A ratio of two systems is then taken turn by turn, between measurements
seconds apart, not a minute apart: on a shared 2-core VM the machine's speed
drifts by more than the differences measured (one raydp cluster ran 47,000
and 71,000 req/s a minute apart). Idle, the others cost a
turn almost nothing: their engines and clients block in ``poll``.

Ray actors and Ray Serve, 15-110x slower, run on their own, one round at a
time, so their controllers' background work never lands in another system's
window.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from benchmarks.common import DP_SIZE, ECHO_ENGINE, PROMPT, Sizes, log, ratio
from benchmarks.roundtrip.pipe import ManyRunner, pipe_target
from benchmarks.roundtrip.targets import (
    EchoTarget,
    RaydpTarget,
    RoundTrip,
    measure_round_trips,
    ray_actor_target,
    raydp_target,
    round_trip_of,
    run_pipelined,
    run_sequential,
    serve_target,
    zmq_target,
)

ROUNDS = 3  # rounds of each system measured on its own (Ray's)
OURS, FLOOR = "raydp (DP=2)", "raw ZMQ + msgspec (2 server procs)"
CURVE = "raydp over TCP + CURVE (the cross-node path)"
TCP, PIPE = "raydp over TCP, auth='none'", "raw ZMQ PUSH/PULL + msgspec, one pipe (the second floor)"
# The watchdog's cost, on the mp backend (no Ray resources: the bench's Ray has room for two clusters).
WATCHED, UNWATCHED = "raydp mp backend", "raydp mp backend, progress watchdog off (step_timeout_s=None)"


class Runner(Protocol):
    """A system taking turns: one pipelined window, one sequential slice."""

    def pipelined(self, seconds: float) -> float: ...

    def sequential(self, n: int) -> list[float]: ...


class EchoRunner:
    """An :class:`EchoTarget` taking turns; request ids never repeat across turns."""

    def __init__(self, target: EchoTarget, sizes: Sizes) -> None:
        self.target, self.sizes, self._next = target, sizes, 0
        run_sequential(target, sizes.warmup, first=-sizes.warmup)

    def _ids(self, n: int) -> int:
        first, self._next = self._next, self._next + n
        return first

    def pipelined(self, seconds: float) -> float:
        first = self._ids(10**8)  # more than a window sends
        return run_pipelined(self.target, self.sizes.pipelined, self.sizes.window, seconds, first=first)

    def sequential(self, n: int) -> list[float]:
        return run_sequential(self.target, n, first=self._ids(n))


def _raydp_runners(stack: contextlib.ExitStack[Any], sizes: Sizes) -> dict[str, Callable[[], Runner]]:
    """raydp's four rows: three clients of a default cluster, one of a cluster with ``auth="none"``."""
    import raydp
    from raydp.client.client import Client

    clusters: dict[str, Any] = {}

    def cluster(auth: str, **fields: Any) -> Any:  # launched on first use, closed with the stack
        key = "-".join([auth, *(f"{k}-{v}" for k, v in fields.items())])
        if key not in clusters:
            name = "bench" if key == "curve" else f"bench-{len(clusters)}"
            clusters[key] = stack.enter_context(
                raydp.launch(name=name, dp_size=DP_SIZE, engine=ECHO_ENGINE, progress=False, auth=auth, **fields)
            )
        return clusters[key]

    def from_elsewhere(auth: str) -> Any:
        """A client that takes the cross-node path: not on the engines' node, so TCP (CURVE with it)."""
        client = Client(cluster(auth).endpoints, node_id=None)
        stack.callback(client.close)
        return client

    many = f"raydp submit_many (DP=2, batches of {sizes.window})"
    return {
        OURS: lambda: EchoRunner(RaydpTarget(cluster("curve").client()), sizes),
        many: lambda: ManyRunner(cluster("curve").client(), sizes.window),
        CURVE: lambda: EchoRunner(RaydpTarget(from_elsewhere("curve")), sizes),
        TCP: lambda: EchoRunner(RaydpTarget(from_elsewhere("none")), sizes),
        WATCHED: lambda: EchoRunner(RaydpTarget(cluster("curve", backend="mp").client()), sizes),
        UNWATCHED: lambda: EchoRunner(RaydpTarget(cluster("curve", backend="mp", step_timeout_s=None).client()), sizes),
    }


def round_trip_benchmark(sizes: Sizes, rounds: int = ROUNDS) -> list[RoundTrip]:
    """Every system's round trips: the ZeroMQ-class ones taking turns, then Ray's, each on its own."""
    alone: dict[str, Callable[[], AbstractContextManager[EchoTarget]]] = {
        "Ray actor calls (2 actors)": lambda: ray_actor_target(placement_groups=False),
        "Ray actors in STRICT_PACK PGs": lambda: ray_actor_target(placement_groups=True),
        "Ray Serve (2 replicas, handle)": lambda: serve_target(sizes.window),
    }
    # Untimed: whatever ran first after ray.init measured 3-6x slow (Ray was still
    # starting its worker pool and agents), which once passed for an IPC deficit.
    log("round trips: warm-up (untimed)")
    with raydp_target() as warm:
        EchoRunner(warm, sizes).pipelined(sizes.pipelined_s)
    with contextlib.ExitStack() as stack:
        systems = _raydp_runners(stack, sizes)
        systems[FLOOR] = lambda: EchoRunner(stack.enter_context(zmq_target()), sizes)
        systems[PIPE] = lambda: EchoRunner(stack.enter_context(pipe_target()), sizes)
        results = _take_turns(systems, sizes)
    for system, make in alone.items():
        results.append(_alone(system, make, sizes, rounds))
    return results


def _take_turns(systems: dict[str, Callable[[], Runner]], sizes: Sizes) -> list[RoundTrip]:
    rates: dict[str, list[float]] = {name: [] for name in systems}
    slices: dict[str, list[list[float]]] = {name: [] for name in systems}
    failed: dict[str, str] = {}
    runners: dict[str, Runner] = {}
    for name, make in systems.items():
        try:
            runners[name] = make()
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    names = list(runners)
    for turn in range(sizes.turns):
        log(f"round trips, turn {turn + 1}/{sizes.turns} of {len(names)} systems side by side")
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            if name in failed:
                continue
            try:
                rates[name].append(runners[name].pipelined(sizes.pipelined_s))
                slices[name].append(runners[name].sequential(sizes.sequential))
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
    return [
        RoundTrip(name, error=failed[name]) if name in failed else round_trip_of(name, rates[name], slices[name])
        for name in systems
    ]


def _alone(system: str, make: Callable[[], AbstractContextManager[EchoTarget]], sizes: Sizes, rounds: int) -> RoundTrip:
    found: list[RoundTrip] = []
    for n in range(rounds):
        log(f"round trips, round {n + 1}/{rounds}: {system}")
        try:
            with make() as target:
                found.append(measure_round_trips(system, target, sizes, rounds))
        except Exception as exc:
            return RoundTrip(system, error=f"{type(exc).__name__}: {exc}")

    def med(attr: str) -> float:
        return float(statistics.median(getattr(r, attr) for r in found))

    return RoundTrip(
        system,
        med("pipelined_rps"),
        med("sequential_rps"),
        med("p50_ms"),
        med("p99_ms"),
        windows=[r.pipelined_rps for r in found],
        p50_windows=[r.p50_ms for r in found],
    )


# ---- the table ---------------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    return f"{min(values):,.0f} - {max(values):,.0f}" if len(values) > 1 else "-"


def _ratio_range(a: RoundTrip, b: RoundTrip, attr: str = "windows") -> str:
    """The ratio's median over turns, and its range (turns are paired by index: seconds apart)."""
    pairs = [x / y for x, y in zip(getattr(a, attr), getattr(b, attr), strict=False) if y]
    if len(pairs) < 2:
        return ""
    return f" (turn by turn: median {statistics.median(pairs):.2f}, range {min(pairs):.2f} - {max(pairs):.2f})"


def _floor_ratios(results: list[RoundTrip]) -> list[str]:
    """The issue's targets: raydp against both floors and the TCP paths, with their spread over turns."""
    found = {r.system: r for r in results if r.error is None}
    ours, floor, pipe = found.get(OURS), found.get(FLOOR), found.get(PIPE)
    many = next((r for name, r in found.items() if "submit_many" in name), None)
    lines = [""]
    if ours and floor:
        lines.append(
            f"Targets: same-node IPC pipelined / raw floor = {ours.pipelined_rps / floor.pipelined_rps:.2f} "
            f"(>= 0.9){_ratio_range(ours, floor)}; sequential p50 / raw floor p50 = "
            f"{ours.p50_ms / floor.p50_ms:.2f} (<= 1.3){_ratio_range(ours, floor, 'p50_windows')}"
        )
    for name in (CURVE, TCP):
        other = found.get(name)
        if ours and other:
            lines.append(
                f"same-node IPC / {name.removeprefix('raydp over ')} pipelined = "
                f"{ours.pipelined_rps / other.pipelined_rps:.2f} (>= 1){_ratio_range(ours, other)}"
            )
    watched, unwatched = found.get(WATCHED), found.get(UNWATCHED)
    if watched and unwatched:
        lines.append(
            f"watchdog on / off (mp backend) pipelined = {watched.pipelined_rps / unwatched.pipelined_rps:.2f}, "
            f"sequential p50 = {watched.p50_ms / unwatched.p50_ms:.2f} (~1: it costs one clock read per loop "
            f"turn){_ratio_range(watched, unwatched)}"
        )
    if many and pipe:
        lines.append(
            f"submit_many / one raw pipe = {many.pipelined_rps / pipe.pipelined_rps:.2f} "
            f"(>= 0.3){_ratio_range(many, pipe)}"
        )
    return lines


def round_trip_table(results: list[RoundTrip], sizes: Sizes) -> list[str]:
    ours = results[0]
    lines = [
        f"### Request round trips (DP=2, prompt of {len(PROMPT)} tokens, max_tokens=1)",
        "",
        f"The first eight systems are open at once and take {sizes.turns} turns, in rotating order: each turn, "
        f"a pipelined window of {sizes.pipelined_s:g} s ({sizes.window} in flight) and {sizes.sequential} "
        f"requests one at a time each; figures are medians over turns, ratios are taken turn by turn. The IPC, "
        f"TCP + CURVE and submit_many rows are three clients of one cluster (a client off the engines' node "
        f"takes TCP). Ray's systems run alone, {ROUNDS} rounds each, with as much pipelined time and as many "
        f"requests.",
        "",
        "| system | pipelined req/s | min - max | raydp / it | sequential req/s | raydp / it | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.system} | failed: {r.error} | | | | | | |")
            continue
        if not r.sequential_rps:  # batches only: no one-at-a-time figures
            lines.append(
                f"| {r.system} | {r.pipelined_rps:,.0f} | {_spread(r.windows)} "
                f"| {ratio(ours.pipelined_rps, r.pipelined_rps)} | - | - | - | - |"
            )
            continue
        lines.append(
            f"| {r.system} | {r.pipelined_rps:,.0f} | {_spread(r.windows)} "
            f"| {ratio(ours.pipelined_rps, r.pipelined_rps)} | {r.sequential_rps:,.0f} "
            f"| {ratio(ours.sequential_rps, r.sequential_rps)} | {r.p50_ms:.2f} | {r.p99_ms:.2f} |"
        )
    lines += _floor_ratios(results)
    others = [r for r in results[1:] if r.error is None and r.sequential_rps]
    if ours.error is None and others:
        for kind, attr in (("pipelined", "pipelined_rps"), ("sequential", "sequential_rps")):
            parts = [f"{ratio(getattr(ours, attr), getattr(r, attr))} {r.system}" for r in others]
            lines += ["", f"{kind}: raydp is " + ", ".join(parts) + "."]
    lines += [
        "",
        "raydp's engine answers every request that arrived in one step with one message, so when "
        "pipelining it can match or beat the raw floor, which answers each request on its own.",
    ]
    return lines
