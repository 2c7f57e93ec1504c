"""The benchmark's sections: what each runs, prints and records, by the name ``--only`` takes.

Every section is one table (``scale`` and ``startup`` share a module); its
module measures and formats, and a :class:`Section` here says how the run
calls it: with ``quick`` for the small sizes, inside the bench's own local
Ray or not (``needs_ray``), by default or only when named (``opt_in``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

from benchmarks import adapters, autoscale, coordinator, gang, lockstep, prefix_cache, routing, scale, workers
from benchmarks.common import FULL, QUICK, Sizes, log
from benchmarks.faults import dense, extra
from benchmarks.faults.table import FaultRow, faults_failed, faults_table
from benchmarks.frontend import compare as frontend
from benchmarks.frontend.load import HTTP_FULL, HTTP_QUICK
from benchmarks.roundtrip import turns as roundtrip
from benchmarks.roundtrip.targets import RoundTrip
from benchmarks.vllm_dp.bench import vllm_benchmark
from benchmarks.vllm_dp.run import VllmReport, vllm_failed
from benchmarks.vllm_dp.table import vllm_table

R = TypeVar("R")


@dataclass(frozen=True)
class Section(Generic[R]):
    """One section: ``run(quick)`` measures, ``table(result, quick)`` prints, ``failed(result)`` judges."""

    name: str
    run: Callable[[bool], R]
    table: Callable[[R, bool], list[str]]
    failed: Callable[[R], bool]
    to_json: Callable[[R, bool], Any]
    needs_ray: bool = True  # runs inside the bench's local Ray (else it starts what it needs, or needs no Ray)
    opt_in: bool = False  # runs only when named with --only
    own_ray: bool = False  # connects this process to a Ray it starts (the bench's must be down)
    aliases: tuple[str, ...] = ()


def _sizes(quick: bool) -> Sizes:
    return QUICK if quick else FULL


def _any_error(results: list[Any]) -> bool:
    return any(r.error for r in results)


def _rows(results: list[Any], quick: bool) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]


Floor = dict[float, tuple[float, float]] | str
Lockstep = tuple[list[lockstep.StepRate], Floor]


def _lockstep_json(result: Lockstep, quick: bool) -> dict[str, Any]:
    steps, floor = result
    floors = (
        {"error": floor}
        if isinstance(floor, str)
        else {str(d): {"bare_loop": a, "gloo_allreduce": b} for d, (a, b) in floor.items()}
    )
    return {"step_rates": [asdict(r) for r in steps], "floor": floors}


def _with_sizes(sizes: Callable[[bool], Any]) -> Callable[[list[Any], bool], dict[str, Any]]:
    def to_json(results: list[Any], quick: bool) -> dict[str, Any]:
        return {"sizes": asdict(sizes(quick)), "results": [asdict(r) for r in results]}

    return to_json


def _http_sizes(quick: bool) -> Any:
    return HTTP_QUICK if quick else HTTP_FULL


def _worker_sizes(quick: bool) -> Any:
    return workers.WORKERS_QUICK if quick else workers.WORKERS_FULL


def _routing_sizes(quick: bool) -> Any:
    return routing.ROUTING_QUICK if quick else routing.ROUTING_FULL


def _adapter_sizes(quick: bool) -> adapters.AdapterSizes:
    return adapters.ADAPTERS_QUICK if quick else adapters.ADAPTERS_FULL


def _coordinator_sizes(quick: bool) -> Any:
    return coordinator.COORDINATOR_QUICK if quick else coordinator.COORDINATOR_FULL


def _prefix_sizes(quick: bool) -> prefix_cache.PrefixSizes:
    return prefix_cache.PREFIX_QUICK if quick else prefix_cache.PREFIX_FULL


def _trials(quick: bool) -> int:
    return 2 if quick else 5


SECTIONS: tuple[Section[Any], ...] = (
    Section[list[RoundTrip]](
        "round-trips",
        run=lambda quick: roundtrip.round_trip_benchmark(_sizes(quick), rounds=1 if quick else 3),
        table=lambda results, quick: roundtrip.round_trip_table(results, _sizes(quick)),
        failed=_any_error,
        to_json=_rows,
        aliases=("roundtrip", "round-trip"),
    ),
    Section[Lockstep](
        "lockstep",
        run=lambda quick: lockstep.lockstep_benchmark(_sizes(quick)),
        table=lambda result, quick: lockstep.lockstep_table(result[0], result[1], _sizes(quick)),
        failed=lambda result: _any_error(result[0]) or isinstance(result[1], str),
        to_json=_lockstep_json,
    ),
    Section[list[frontend.HttpResult]](
        "http",
        run=lambda quick: frontend.http_benchmark(_http_sizes(quick), log),
        table=lambda results, quick: frontend.http_table(results, _http_sizes(quick)),
        failed=frontend.http_failed,
        to_json=_with_sizes(_http_sizes),
    ),
    Section[list[workers.StepLatency]](
        "workers",
        run=lambda quick: workers.workers_benchmark(_worker_sizes(quick)),
        table=lambda results, quick: workers.workers_table(results, _worker_sizes(quick)),
        failed=workers.workers_failed,
        to_json=_with_sizes(_worker_sizes),
    ),
    Section[list[scale.ScaleTiming]](
        "scale",
        run=lambda quick: scale.scale_benchmark(reps=2 if quick else 5),
        table=lambda results, quick: scale.scale_table(results),
        failed=scale.scale_failed,
        to_json=_rows,
    ),
    Section[list[scale.ScaleTiming]](
        "startup",
        run=lambda quick: scale.startup_benchmark(reps=1 if quick else 3),
        table=lambda results, quick: scale.startup_table(results),
        failed=scale.scale_failed,
        to_json=_rows,
    ),
    Section[list[coordinator.CoordinatorResult]](
        "coordinator",
        run=lambda quick: coordinator.coordinator_benchmark(_coordinator_sizes(quick)),
        table=lambda results, quick: coordinator.coordinator_table(results),
        failed=coordinator.coordinator_failed,
        to_json=_rows,
        needs_ray=False,
    ),
    Section[list[routing.RoutingResult]](
        "routing",
        run=lambda quick: routing.routing_benchmark(_routing_sizes(quick)),
        table=lambda results, quick: routing.routing_table(results, _routing_sizes(quick)),
        failed=routing.routing_failed,
        to_json=_rows,
    ),
    Section[list[adapters.AdapterResult]](
        "adapters",
        run=lambda quick: adapters.adapters_benchmark(_adapter_sizes(quick)),
        table=lambda results, quick: adapters.adapters_table(results, _adapter_sizes(quick)),
        failed=adapters.adapters_failed,
        to_json=_rows,
        needs_ray=False,
    ),
    Section[list[autoscale.AutoscaleResult]](
        "autoscale",
        run=lambda quick: autoscale.autoscale_benchmark(autoscale.STEP_QUICK if quick else autoscale.STEP_FULL),
        table=lambda results, quick: autoscale.autoscale_table(
            results, autoscale.STEP_QUICK if quick else autoscale.STEP_FULL
        ),
        failed=autoscale.autoscale_failed,
        to_json=_rows,
        needs_ray=False,
        opt_in=True,
    ),
    Section[list[FaultRow]](
        "faults",
        run=lambda quick: dense.faults_benchmark(trials=_trials(quick)),
        table=lambda rows, quick: faults_table(rows),
        failed=faults_failed,
        to_json=_rows,
        needs_ray=False,
    ),
    Section[list[FaultRow]](
        "faults-extra",
        run=lambda quick: extra.extra_benchmark(trials=_trials(quick)),
        table=lambda rows, quick: extra.extra_table(rows),
        failed=faults_failed,
        to_json=_rows,
        needs_ray=False,
        opt_in=True,
    ),
    Section[list[gang.GangRow]](
        "gang",
        run=lambda quick: gang.gang_benchmark(reps=2 if quick else 5),
        table=lambda rows, quick: gang.gang_table(rows),
        failed=gang.gang_failed,
        to_json=_rows,
        needs_ray=False,
        opt_in=True,
        own_ray=True,
    ),
    Section[VllmReport](
        "vllm",
        run=vllm_benchmark,
        table=lambda report, quick: vllm_table(report),
        failed=vllm_failed,
        to_json=lambda report, quick: report.as_json(),
        needs_ray=False,
        opt_in=True,
    ),
    Section[list[prefix_cache.PrefixResult]](
        "prefix",
        run=lambda quick: prefix_cache.prefix_benchmark(_prefix_sizes(quick)),
        table=lambda results, quick: prefix_cache.prefix_table(results, _prefix_sizes(quick)),
        failed=prefix_cache.prefix_failed,
        to_json=_rows,
        needs_ray=False,
        opt_in=True,
        aliases=("prefix-cache",),
    ),
)
BY_NAME: dict[str, Section[Any]] = {n: s for s in SECTIONS for n in (s.name, *s.aliases)}


def pick(only: list[str] | None, skip: list[str] | None) -> list[Section[Any]]:
    """The sections to run, in run order: ``only``'s (else every one not opt-in), less ``skip``'s."""
    chosen = {BY_NAME[n].name for n in only} if only else {s.name for s in SECTIONS if not s.opt_in}
    chosen -= {BY_NAME[n].name for n in skip or []}
    return [s for s in SECTIONS if s.name in chosen]
