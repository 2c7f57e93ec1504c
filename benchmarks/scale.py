"""Elastic scaling: the time to add one rank and to remove one, against a fresh launch and a bare actor.

In one local Ray (4 logical GPUs), per mode (dense, lockstep):

* ``scale(3)`` on a DP=2 cluster (add one rank: plan, placement group,
  actor, handshake, clients told), then ``scale(2)`` (remove one: drain,
  retire, actor and group gone), repeated; in lockstep mode each change also
  holds the gang and re-forms its DP group;
* a fresh ``launch`` of DP=3 and its ``close``, the alternative to scaling;
* the baselines: a bare Ray actor started in a new STRICT_PACK placement
  group shaped like a rank's (one ``{"GPU": 1}`` and one ``{"CPU": 1}``
  bundle), until its first method call returns; and the same actor importing
  torch (a lockstep rank imports it for its gloo group; a dense echo rank does not).

Medians of ``reps`` each. The target: adding a rank takes at most 1.5x the
bare actor start (and far less than the ~30 s of vLLM's elastic EP scaling).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.common import log

TARGET_ADD_VS_BARE = 1.5
# After each startup run (bare actors or a cluster), before the next: the processes just
# stopped take a second or two to exit (a torch-importing interpreter's teardown), and a
# start that races them on 2 cores measures the teardown, not itself.
SETTLE_S = 2.0
BARE = "bare Ray actor in a new placement group"
BARE_TORCH = "bare Ray actor that imports torch, in a new placement group"


@dataclass(frozen=True)
class ScaleTiming:
    what: str
    mode: str  # "dense", "lockstep" or "" (the baseline)
    median_s: float
    spread_s: tuple[float, float]  # min, max
    reps: int
    error: str = ""


def _timed(what: str, mode: str, reps: int, once: Callable[[], float]) -> ScaleTiming:
    times = []
    try:
        for _ in range(reps):
            times.append(once())
    except Exception as exc:  # a failed measurement is reported, not fatal
        log(f"scale bench: {what} ({mode}) failed: {exc!r}")
        return ScaleTiming(what, mode, float("nan"), (float("nan"), float("nan")), len(times), repr(exc)[:200])
    return ScaleTiming(what, mode, statistics.median(times), (min(times), max(times)), reps)


class _BareActor:
    def __init__(self, import_torch: bool) -> None:
        self.ready = True
        if import_torch:
            import torch

            self.ready = bool(torch.zeros(1).sum() == 0)

    def ping(self) -> bool:
        return self.ready


def _bare_actor_start(import_torch: bool) -> float:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started = time.perf_counter()
    group = placement_group([{"GPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    actor = (
        ray.remote(_BareActor)
        .options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, 1))
        .remote(import_torch)
    )
    ray.get(actor.ping.remote(), timeout=60)
    took = time.perf_counter() - started
    ray.kill(actor)
    remove_placement_group(group)
    time.sleep(0.5)  # let Ray hand the resources back before the next start
    return took


def _mode_kwargs(mode: str) -> dict[str, Any]:
    if mode == "lockstep":
        return {"lockstep": True, "engine_kwargs": {"collective": True}}
    return {}


def _scale_times(mode: str, reps: int) -> tuple[ScaleTiming, ScaleTiming]:
    import raydp

    adds: list[float] = []
    removes: list[float] = []
    with raydp.launch(name=f"bench-scale-{mode}", dp_size=2, progress=False, **_mode_kwargs(mode)) as cluster:
        client = cluster.client()
        client.generate([1], max_tokens=2)
        for _ in range(reps):
            started = time.perf_counter()
            cluster.scale(3)
            adds.append(time.perf_counter() - started)
            assert client.generate([2], max_tokens=2, rank=2) == [2, 2]
            started = time.perf_counter()
            cluster.scale(2, drain_timeout_s=10)
            removes.append(time.perf_counter() - started)

    def timing(what: str, times: list[float]) -> ScaleTiming:
        return ScaleTiming(what, mode, statistics.median(times), (min(times), max(times)), len(times))

    return timing("add one rank (DP 2 -> 3)", adds), timing("remove one rank (DP 3 -> 2)", removes)


def _fresh_launch(mode: str) -> float:
    import raydp

    started = time.perf_counter()
    cluster = raydp.launch(name=f"bench-fresh-{mode}", dp_size=3, progress=False, **_mode_kwargs(mode))
    took = time.perf_counter() - started
    cluster.close()
    return took


def _bare_gang_start(ranks: int) -> float:
    """``ranks`` bare torch-importing actors in ``ranks`` STRICT_PACK groups, started together."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started = time.perf_counter()
    groups = [placement_group([{"GPU": 1}, {"CPU": 1}], strategy="STRICT_PACK") for _ in range(ranks)]
    ray.get([g.ready() for g in groups], timeout=60)
    actors = [
        ray.remote(_BareActor)
        .options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(g, 1))
        .remote(True)
        for g in groups
    ]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    took = time.perf_counter() - started
    for actor in actors:
        ray.kill(actor)
    for group in groups:
        remove_placement_group(group)
    time.sleep(SETTLE_S)
    return took


def _launch_to_serving(ranks: int, mode: str) -> float:
    import raydp

    started = time.perf_counter()
    cluster = raydp.launch(name=f"bench-start-{mode}", dp_size=ranks, progress=False, **_mode_kwargs(mode))
    client = cluster.client()
    client.generate([1], max_tokens=1, rank=ranks - 1)
    took = time.perf_counter() - started
    cluster.close()
    time.sleep(SETTLE_S)
    return took


def startup_benchmark(reps: int, ranks: int = 4) -> list[ScaleTiming]:
    """Time to a serving DP=``ranks`` cluster against the bare actors it would otherwise be."""
    return [
        _timed(
            f"{ranks} bare actors (import torch) in {ranks} STRICT_PACK groups",
            "",
            reps,
            lambda: _bare_gang_start(ranks),
        ),
        _timed(
            f"launch DP={ranks} until a request is answered", "dense", reps, lambda: _launch_to_serving(ranks, "dense")
        ),
        _timed(
            f"launch DP={ranks} until a request is answered",
            "lockstep",
            reps,
            lambda: _launch_to_serving(ranks, "lockstep"),
        ),
    ]


def _timing_rows(results: list[ScaleTiming], bases: list[float]) -> list[str]:
    """One table row per timing, with its ratio to each of ``bases``."""
    rows = []
    for r in results:
        if r.error:
            rows.append(f"| {r.what} | {r.mode or '-'} | failed: {r.error} |" + " |" * (len(bases) + 1))
            continue
        ratios = "".join(f" {r.median_s / b:.2f}x |" for b in bases)
        rows.append(
            f"| {r.what} | {r.mode or '-'} | {r.median_s:.2f} s | {r.spread_s[0]:.2f} - {r.spread_s[1]:.2f} s |{ratios}"
        )
    return rows


def startup_table(results: list[ScaleTiming]) -> list[str]:
    base = results[0].median_s
    lines = [
        "### Startup: a serving DP=4 cluster against bare actors",
        "",
        "| what | mode | median | min - max | vs bare actors |",
        "|---|---|---:|---:|---:|",
        *_timing_rows(results, [base]),
    ]
    verdicts = [
        f"{r.mode}: {r.median_s / base:.2f}x ({'met' if r.median_s / base <= 1.5 else 'missed'})"
        for r in results[1:]
        if not r.error
    ]
    return [*lines, "", "Target: <= 1.5x the bare actors. " + "; ".join(verdicts)]


def scale_benchmark(reps: int) -> list[ScaleTiming]:
    log(f"scale bench: {reps} reps per measurement")
    results = [
        _timed(BARE, "", reps, lambda: _bare_actor_start(False)),
        _timed(BARE_TORCH, "", reps, lambda: _bare_actor_start(True)),
    ]
    for mode in ("dense", "lockstep"):
        try:
            results += _scale_times(mode, reps)
        except Exception as exc:
            log(f"scale bench: scaling ({mode}) failed: {exc!r}")
            results.append(ScaleTiming("add/remove one rank", mode, float("nan"), (0.0, 0.0), 0, repr(exc)[:200]))
        results.append(_timed("fresh launch of DP=3", mode, reps, lambda m=mode: _fresh_launch(m)))  # type: ignore[misc]
    return results


def scale_failed(results: list[ScaleTiming]) -> bool:
    return any(r.error for r in results)


def scale_table(results: list[ScaleTiming]) -> list[str]:
    bare = next((r.median_s for r in results if r.what == BARE), float("nan"))
    bare_torch = next((r.median_s for r in results if r.what == BARE_TORCH), float("nan"))
    lines = [
        "### Elastic scaling: add and remove one rank",
        "",
        "| what | mode | median | min - max | vs bare actor | vs bare actor + torch |",
        "|---|---|---:|---:|---:|---:|",
        *_timing_rows(results, [bare, bare_torch]),
    ]
    # A dense echo rank imports no torch; a lockstep rank must (its gloo group): compare like with like.
    verdicts = []
    for r in results:
        if r.what.startswith("add") and not r.error:
            base, label = (bare_torch, "bare actor + torch") if r.mode == "lockstep" else (bare, "bare actor")
            met = "met" if r.median_s / base <= TARGET_ADD_VS_BARE else "missed"
            verdicts.append(f"{r.mode}: {r.median_s / base:.2f}x a {label} ({met})")
    lines += ["", f"Target: adding a rank <= {TARGET_ADD_VS_BARE}x a bare actor start. " + "; ".join(verdicts)]
    return lines
