"""Lockstep gang restart: from one rank's death until every rank serves again.

Run as ``flock /tmp/raydp-ray.lock .venv/bin/python -m benchmarks.gang [--reps 5] [--sizes 2 3]``, or as
the opt-in ``gang`` section of ``python -m benchmarks`` (``--only gang``).
It starts its own local ``ray.cluster_utils.Cluster`` (one node, 4 CPUs,
4 logical GPUs) and, per DP size, launches one lockstep cluster of
``EchoEngine(collective=True)`` ranks with enough ``max_restarts`` for every
repetition. Each repetition kills one rank (a different one each time) with
``ray.kill`` while the gang is busy (a long request runs on another rank, so
a wave is running; ``step_delay_s=0.01`` stands in for device time) and times:

* detection: the death until ``cluster.deaths`` lists it;
* back: the death until a request to every rank is answered again.

It prints the medians (and min/max), next to the floor of any restart that
replaces the gang's processes: as many bare torch-importing Ray actors,
started together in new STRICT_PACK groups, until each answers a call
(:mod:`benchmarks.scale`'s startup baseline). The target: a gang back within 5 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.scale import _bare_gang_start

TARGET_BACK_S = 5.0
DETECT_POLL_S = 0.005  # reads a list
SERVE_POLL_S = 0.05  # sends requests: on 2 cores a tighter loop slows the restart it waits for


def _serving(client: Any, ranks: int) -> bool:
    import raydp

    try:
        return all(client.generate([r], max_tokens=2, rank=r, timeout=2) == [r, r] for r in range(ranks))
    except raydp.RaydpError:
        return False


def _one_restart(cluster: Any, client: Any, ranks: int, victim: int, name: str) -> tuple[float, float]:
    import ray

    import raydp

    seen = len(cluster.deaths)
    actor = ray.get_actor(f"{name}-dp{victim}", namespace="raydp")
    busy = client.submit([7], max_tokens=10_000_000, rank=(victim + 1) % ranks)
    time.sleep(0.2)  # in its wave
    killed_at = time.perf_counter()
    ray.kill(actor)
    while len(cluster.deaths) <= seen:
        if time.perf_counter() - killed_at > 60:
            raise TimeoutError(f"rank {victim}'s death was not reported in 60 s")
        time.sleep(DETECT_POLL_S)
    detected = time.perf_counter() - killed_at
    while not _serving(client, ranks):
        if time.perf_counter() - killed_at > 120:
            raise TimeoutError(f"the gang did not serve again within 120 s of rank {victim}'s death")
        time.sleep(SERVE_POLL_S)
    back = time.perf_counter() - killed_at
    try:
        busy.result(timeout=30)
    except raydp.RaydpError:
        pass  # stopped with its gang, typed (EngineDeadError, or the engine's error if its step failed first)
    else:
        raise AssertionError("a request in flight on the stopped gang finished")
    return detected, back


def gang_times(ranks: int, reps: int) -> tuple[list[float], list[float]]:
    import raydp

    name = f"bench-gang{ranks}"
    detections, backs = [], []
    with raydp.launch(
        name=name,
        dp_size=ranks,
        lockstep=True,
        max_restarts=reps,
        progress=False,
        engine_kwargs={"collective": True, "step_delay_s": 0.01},
    ) as cluster:
        client = cluster.client()
        assert _serving(client, ranks), "the fresh gang does not serve"
        for rep in range(reps):
            detected, back = _one_restart(cluster, client, ranks, rep % ranks, name)
            print(
                f"[bench-gang] DP={ranks} rep {rep}: killed rank {rep % ranks}, detected in {detected:.3f}s, "
                f"serving again in {back:.2f}s",
                file=sys.stderr,
                flush=True,
            )
            detections.append(detected)
            backs.append(back)
            time.sleep(0.5)  # let the killed actors' processes go before the next death
    return detections, backs


def floor_times(ranks: int, reps: int) -> list[float]:
    return [_bare_gang_start(ranks) for _ in range(reps)]


def _fmt(times: list[float]) -> str:
    return f"{statistics.median(times):.2f} s ({min(times):.2f}-{max(times):.2f})"


@dataclass
class GangRow:
    """One DP size's restarts: seconds per repetition, and the floor's."""

    ranks: int
    detect_s: list[float]
    back_s: list[float]
    floor_s: list[float]


def gang_benchmark(sizes: tuple[int, ...] = (2, 3), reps: int = 5) -> list[GangRow]:
    """Every DP size's rows, on a Ray of its own (one node, 4 CPUs, 4 logical GPUs)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    rows = []
    try:
        for ranks in sizes:
            detections, backs = gang_times(ranks, reps)
            rows.append(GangRow(ranks, detections, backs, floor_times(ranks, reps)))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


def gang_failed(rows: list[GangRow]) -> bool:
    return not rows or any(statistics.median(r.back_s) > TARGET_BACK_S for r in rows)


def gang_table(rows: list[GangRow]) -> list[str]:
    lines = [
        "### Lockstep gang restart: one rank killed until every rank serves again",
        "",
        "| DP ranks | death -> detected | death -> every rank serves | floor: bare torch actors start | target |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        verdict = "met" if statistics.median(r.back_s) <= TARGET_BACK_S else "missed"
        lines.append(
            f"| {r.ranks} | {_fmt(r.detect_s)} | {_fmt(r.back_s)} | {_fmt(r.floor_s)} "
            f"| <= {TARGET_BACK_S:.0f} s: {verdict} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    rows = gang_benchmark(tuple(args.sizes), args.reps)
    print(
        f"\ncommand: flock /tmp/raydp-ray.lock .venv/bin/python -m benchmarks.gang --reps {args.reps} "
        f"--sizes {' '.join(map(str, args.sizes))}  ({os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())})"
    )
    print("\n".join(gang_table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
