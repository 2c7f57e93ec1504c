"""Device workers: the per-step round trip of one rank's workers, raydp's channel against Ray's own paths.

Per world size (1, 2, 4), one step broadcasts a small step input to every
worker and gathers the driver worker's (TP rank 0's) output, through:

* a direct in-process call of the worker (the floor: no process hop at all);
* raydp's channel: :class:`~raydp.actors.workers.RayExecutor`, whose
  ``execute_step`` writes one frame per worker on a Unix socket;
* a plain Ray actor call per worker per step, ``ray.get`` on all of them;
* a Ray Compiled Graph (``ray.dag``, ``experimental_compile``) over the same
  plain actors: shared-memory channels set up once, no task submission per step.

Each system lives in a STRICT_PACK placement group shaped like raydp's rank
groups (``world_size`` ``{"GPU": 1}`` bundles and one ``{"CPU": 1}``). The
local Ray has 4 logical GPUs, so raydp's workers and the Ray actors cannot
hold their groups at once at world size 4: each world size runs a raydp
phase, then a Ray phase (plain calls and the Compiled Graph over the same
actors, alternating in chunks), the direct call alternating with raydp.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks.common import TIMEOUT_S, log, ratio

WORLD_SIZES = (1, 2, 4)
ECHO_WORKER = "raydp.models.echo_workers:EchoWorker"
# A decode step as an engine might hand it to its workers: 8 running requests as (slot, last token).
STEP_INPUT: dict[str, Any] = {"new": [], "decode": [[i, 17] for i in range(8)], "free": []}
STEP_INPUT_TEXT = '{"new": [], "decode": [[i, 17] for i in range(8)], "free": []}'
CHUNK = 100  # steps one system takes before the next one's turn
TARGET_VS_CGRAPH = 0.5  # raydp median / Compiled Graph median, at most
TARGET_ADDED_US = 100.0  # raydp median - direct median, at most

DIRECT = "direct in-process call (the floor)"
RAYDP = "raydp channel (RayExecutor)"
PLAIN = "plain Ray actor calls"
CGRAPH = "Ray Compiled Graph"
SYSTEMS = (DIRECT, RAYDP, PLAIN, CGRAPH)

Step = Callable[[Any], Any]


@dataclass(frozen=True)
class WorkerSizes:
    """Steps per system and world size; ``--quick`` picks the small set."""

    steps: int  # timed steps
    warmup: int  # untimed steps before them


WORKERS_FULL = WorkerSizes(steps=2000, warmup=200)
WORKERS_QUICK = WorkerSizes(steps=300, warmup=200)


@dataclass
class StepLatency:
    """One system's per-step round trips at one world size, in microseconds."""

    system: str
    world_size: int
    median_us: float = 0.0
    p99_us: float = 0.0
    mean_us: float = 0.0
    steps: int = 0
    error: str | None = None


# ---- timing ------------------------------------------------------------------------------


def warm_up(step: Step, steps: int) -> None:
    """Untimed steps, then one checked: every system must hand back the driver's echo."""
    for _ in range(steps):
        step(STEP_INPUT)
    answer = step(STEP_INPUT)
    if answer != STEP_INPUT:
        raise RuntimeError(f"the driver worker answered {answer!r}")


def time_interleaved(steps: dict[str, Step], n: int) -> dict[str, list[int]]:
    """``n`` timed steps of every system, ``CHUNK`` at a time in turn, so drift hits them alike."""
    samples: dict[str, list[int]] = {name: [] for name in steps}
    clock = time.perf_counter_ns
    gc.collect()
    while any(len(s) < n for s in samples.values()):
        for name, step in steps.items():
            out = samples[name]
            for _ in range(min(CHUNK, n - len(out))):
                start = clock()
                step(STEP_INPUT)
                out.append(clock() - start)
    return samples


def summarize(system: str, world_size: int, samples_ns: list[int]) -> StepLatency:
    us = [s / 1e3 for s in samples_ns]
    return StepLatency(
        system,
        world_size,
        median_us=statistics.median(us),
        p99_us=statistics.quantiles(us, n=100)[98],
        mean_us=statistics.fmean(us),
        steps=len(us),
    )


def measure(world_size: int, steps: dict[str, Step], sizes: WorkerSizes) -> list[StepLatency]:
    """Warm every system up, then time them interleaved; a system that fails gets its error."""
    live, results = {}, []
    for name, step in steps.items():
        try:
            warm_up(step, sizes.warmup)
            live[name] = step
        except Exception as exc:
            results.append(failure(name, world_size, exc))
    samples = time_interleaved(live, sizes.steps)
    return results + [summarize(name, world_size, s) for name, s in samples.items()]


# ---- the systems -------------------------------------------------------------------------


@contextlib.contextmanager
def rank_group(world_size: int) -> Iterator[Any]:
    """A placement group shaped like a raydp rank's: one GPU bundle per worker, one CPU bundle."""
    import ray
    from ray.util.placement_group import placement_group

    from raydp.placement.groups import remove_groups

    group = placement_group([{"GPU": 1}] * world_size + [{"CPU": 1}], strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=TIMEOUT_S)
        yield group
    finally:
        remove_groups([group])  # and wait until its resources are back: the next section needs the GPUs


def direct_step(world_size: int) -> Step:
    """The driver worker called in this process: what a step costs with no hop at all."""
    import ray

    from raydp.engine.executor import WorkerContext
    from raydp.models.echo_workers import EchoWorker

    node_id = ray.get_runtime_context().get_node_id()
    return EchoWorker(WorkerContext(0, 0, world_size, node_id)).execute_step


@contextlib.contextmanager
def raydp_workers(world_size: int) -> Iterator[Step]:
    """A rank's echo workers behind raydp's ``RayExecutor``, as an engine core would start them."""
    import ray

    from raydp.actors.workers import RayExecutor
    from raydp.engine.executor import WorkerGroupSpec
    from raydp.wire.transport import IpcDir

    ipc_dir = IpcDir("bench-dp0")
    spec = WorkerGroupSpec(
        cluster="bench",
        dp_rank=0,
        world_size=world_size,
        worker_class=ECHO_WORKER,
        node_id=ray.get_runtime_context().get_node_id(),
        accelerator="GPU",
        device_ids=(),
        ipc_dir=ipc_dir,
        curve=None,
        max_message_bytes=64 << 20,
        timeout_s=120,
    )
    try:
        with rank_group(world_size) as group:
            executor = RayExecutor(spec, group=group)
            try:
                yield executor.execute_step
            finally:
                executor.close()
    finally:
        ipc_dir.remove()


class PlainWorker:
    """A plain Ray actor doing what raydp's echo worker does: only the driver returns the input."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank

    def execute_step(self, step_input: Any) -> Any:
        return step_input if self.tp_rank == 0 else None


@contextlib.contextmanager
def plain_actors(world_size: int) -> Iterator[list[Any]]:
    """``world_size`` plain actors, one per GPU bundle of a rank-shaped group (as raydp places its workers)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = ray.remote(PlainWorker)
    with rank_group(world_size) as group:
        bundles = [PlacementGroupSchedulingStrategy(group, tp) for tp in range(world_size)]
        actors = [cls.options(num_cpus=0, num_gpus=1, scheduling_strategy=b).remote(tp) for tp, b in enumerate(bundles)]
        try:
            ray.get([a.execute_step.remote(None) for a in actors], timeout=TIMEOUT_S)
            yield actors
        finally:
            for actor in actors:
                ray.kill(actor, no_restart=True)


def plain_step(actors: list[Any]) -> Step:
    """One Ray actor call per worker per step; the driver's result is the step's output."""
    import ray

    def step(step_input: Any) -> Any:
        return ray.get([a.execute_step.remote(step_input) for a in actors], timeout=TIMEOUT_S)[0]

    return step


@contextlib.contextmanager
def compiled_graph(actors: list[Any]) -> Iterator[Step]:
    """The same actors as a Compiled Graph: the input broadcast to all, every output gathered.

    The graph's loop runs in each actor's ``_ray_system`` concurrency group, so
    plain calls still reach the actors while it is compiled (and, measured
    apart, neither is slower for the other's presence). It needs no GPU: the
    step input travels in shared memory, and no tensor transport is declared.
    """
    import logging

    import ray
    from ray.dag import InputNode, MultiOutputNode

    # It logs every actor it cancels at teardown: noise between the progress lines.
    logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.WARNING)
    with InputNode() as inp:
        dag = MultiOutputNode([a.execute_step.bind(inp) for a in actors])
    compiled = dag.experimental_compile()
    try:
        yield lambda step_input: ray.get(compiled.execute(step_input), timeout=TIMEOUT_S)[0]
    finally:
        compiled.teardown()


def failure(system: str, world_size: int, exc: BaseException) -> StepLatency:
    return StepLatency(system, world_size, error=f"{type(exc).__name__}: {exc}")


def raydp_phase(world_size: int, sizes: WorkerSizes) -> list[StepLatency]:
    """The direct call and raydp's workers, alternating; a failed start leaves the direct call alone."""
    log(f"workers: world_size={world_size}: direct call and raydp's channel")
    results: list[StepLatency] = []
    try:
        with raydp_workers(world_size) as step:
            results = measure(world_size, {DIRECT: direct_step(world_size), RAYDP: step}, sizes)
    except Exception as exc:  # kept: what was measured before a failed close
        if not results:
            results = [failure(RAYDP, world_size, exc), *measure(world_size, {DIRECT: direct_step(world_size)}, sizes)]
    return results


def ray_phase(world_size: int, sizes: WorkerSizes) -> list[StepLatency]:
    """Plain calls and the Compiled Graph over the same actors, alternating; either may fail alone."""
    log(f"workers: world_size={world_size}: plain Ray calls and a Compiled Graph")
    results: list[StepLatency] = []
    try:
        with plain_actors(world_size) as actors, contextlib.ExitStack() as stack:
            steps: dict[str, Step] = {PLAIN: plain_step(actors)}
            try:
                steps[CGRAPH] = stack.enter_context(compiled_graph(actors))
            except Exception as exc:
                results.append(failure(CGRAPH, world_size, exc))
            results += measure(world_size, steps, sizes)
    except Exception as exc:  # kept: what was measured before a failed teardown
        done = {r.system for r in results}
        results += [failure(s, world_size, exc) for s in (PLAIN, CGRAPH) if s not in done]
    return results


def workers_benchmark(sizes: WorkerSizes) -> list[StepLatency]:
    """Every system at every world size, in one Ray; results in ``SYSTEMS`` order per world size."""
    results = []
    for world_size in WORLD_SIZES:
        found = raydp_phase(world_size, sizes) + ray_phase(world_size, sizes)
        results += sorted(found, key=lambda r: SYSTEMS.index(r.system))
    return results


# ---- report ------------------------------------------------------------------------------


def workers_table(results: list[StepLatency], sizes: WorkerSizes) -> list[str]:
    lines = [
        "### Device workers: per-step round trip",
        "",
        f"One step broadcasts `{STEP_INPUT_TEXT}` to every worker of one rank and gathers the driver "
        f"worker's output; {sizes.steps} sequential steps per system after {sizes.warmup} untimed, "
        f"the systems of a world size alternating every {CHUNK} steps. Workers are actors in a "
        "STRICT_PACK group of `world_size` `{GPU: 1}` bundles and one `{CPU: 1}`, as raydp places a "
        "rank's workers. Microseconds.",
        "",
        "| world_size | system | median µs | p99 µs | mean µs |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.world_size} | {r.system} | failed: {r.error} | | |")
        else:
            lines.append(f"| {r.world_size} | {r.system} | {r.median_us:,.1f} | {r.p99_us:,.1f} | {r.mean_us:,.1f} |")
    lines += [
        "",
        f"Targets: raydp's median at most {TARGET_VS_CGRAPH}x the Compiled Graph's (bold), and at most "
        f"{TARGET_ADDED_US:g} µs added per step over the direct call.",
        "",
        f"| world_size | **raydp / Compiled Graph** | <= {TARGET_VS_CGRAPH}x | raydp - direct (µs) "
        f"| <= {TARGET_ADDED_US:g} µs | plain Ray / raydp |",
        "|---:|---:|---|---:|---|---:|",
    ]
    for world_size in WORLD_SIZES:
        lines.append(ratio_row(world_size, {r.system: r for r in results if r.world_size == world_size}))
    return lines


def ratio_row(world_size: int, rows: dict[str, StepLatency]) -> str:
    def median(system: str) -> float:
        r = rows.get(system)
        return r.median_us if r is not None and r.error is None else 0.0

    direct, ours, plain, cgraph = (median(s) for s in SYSTEMS)
    vs_cgraph = verdict(ours / cgraph <= TARGET_VS_CGRAPH) if ours and cgraph else "n/a"
    added = f"{ours - direct:,.1f}" if ours and direct else "n/a"
    added_ok = verdict(ours - direct <= TARGET_ADDED_US) if ours and direct else "n/a"
    return f"| {world_size} | **{ratio(ours, cgraph)}** | {vs_cgraph} | {added} | {added_ok} | {ratio(plain, ours)} |"


def verdict(met: bool) -> str:
    return "YES" if met else "NO"


def workers_failed(results: list[StepLatency]) -> bool:
    return any(r.error for r in results)
