"""The failure table: per fault, the time until the cluster detects it and until it serves again; requests lost.

Run alone as ``.venv/bin/python -m benchmarks.faults.dense [--trials N] [--json PATH] [--only GROUP ...]``
or as the ``faults`` section of ``python -m benchmarks`` (which runs this module
in a process of its own: it needs a multi-node Ray, not the bench's single node).
A local Ray of two nodes (2 logical GPUs each); per row, ``trials`` faults
(default 5) under a light load (a driver client's ``retryable`` requests, and
HTTP requests to 2 API servers where they exist):

* a dense cluster (DP=4, two ranks per node, ``EchoEngine``, restarts allowed):
  kill a rank (``SIGKILL``, ``ray.kill``), kill the coordinator (both ways),
  kill an API server process, remove the node of ranks 2 and 3 (a like node
  is added at once, so their re-placement has somewhere to go);
* a TP cluster (DP=2, ``tensor_parallel_size=2``, ``WorkerEchoEngine``): kill
  a device worker (its rank fails and restarts);
* a lockstep gang (DP=2, a collective every step): kill one rank; the whole
  gang restarts;
* the same gang with one rank's loop blocked for good (``hang_now``) under
  ``step_timeout_s`` 2 s: both watchdogs fire (the peer waits in the
  all-reduce), and the gang restarts;
* the same gang with one rank that stops joining the all-reduces
  (``skip_all_reduces_now``): it runs on, its peer's watchdog fires, and the
  gang restarts;
* a dense pair whose rank 1 restarts wedged once after each kill
  (``HangingEchoEngine``, ``hang_in="restart"``, ``startup_timeout_s`` 3 s):
  the successor's own deadline ends it, and the next try serves.

*Detected*: fault to the death report (``Cluster.deaths`` grows; for the
wedged restart, the wedge's ``INIT_FAILED`` report), polled every 5 ms.
*Back*: fault to a request pinned to the affected rank answered
correctly (every rank for a gang or a node; for the coordinator, every rank
resubscribed to the successor and a request answered; for an API server, the
respawned process alive and the endpoint answering), polled every 15 ms.
Medians over the trials. *Lost*: requests that hung or were never answered;
*typed*: requests that failed with a typed error (a ``RaydpError``, an HTTP
error in OpenAI's shape, or a connection the killed API server had open);
*bad*: wrong, answered twice or failed untyped. Lost and bad must be 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common import log
from benchmarks.faults.table import FaultRow, faults_failed, faults_table, rows_from_process
from raydp.testing.fault_load import DriverLoad, HttpLoad, Ledger, LoadShape
from raydp.testing.faults import Injector, LocalRay, wait_for

TRIALS = 5
TARGETS = {"process": 0.1, "rank": 2.0, "coordinator": 2.0, "gang": 5.0}


@dataclass(frozen=True)
class Row:
    label: str
    kind: str
    happens: str


DENSE_ROWS = (
    Row(
        "kill rank (SIGKILL)",
        "rank-sigkill",
        "its requests move (retryable, nothing streamed) or fail typed; restarted in its placement group",
    ),
    Row("kill rank (ray.kill)", "rank-ray-kill", "as SIGKILL; the death cause reads 'killed'"),
    Row(
        "kill coordinator (SIGKILL)",
        "coordinator-sigkill",
        "ranks serve on the last snapshot; restarted at its addresses, state rebuilt from the engines",
    ),
    Row("kill coordinator (ray.kill)", "coordinator-ray-kill", "as SIGKILL"),
    Row(
        "kill API server",
        "api-server-sigkill",
        "its open connections close; the other server keeps accepting; respawned on the shared socket",
    ),
    Row(
        "remove node",
        "node-remove",
        "its ranks die 'node died'; re-placed on a node that joins (or has room) and restarted",
    ),
)
COORDINATOR_NODE_ROW = Row(
    "remove the coordinator's node",
    "coordinator-node-remove",
    "it and rank 0 die 'node died'; a successor starts on a live node at new addresses, the engines are "
    "told over Ray, this process's clients at once and the API servers' once they ask an engine; rank 0 "
    "is re-placed",
)
WORKER_ROW = Row("kill worker (SIGKILL)", "worker-sigkill", "its rank fails (typed) and restarts with new workers")
HANG_STEP_TIMEOUT_S = 2.0  # the watchdog's bound in this row (300 s by default): detection is this and a poll
HANG_ROW = Row(
    f"hang rank (its loop blocks; step_timeout_s {HANG_STEP_TIMEOUT_S:g} s)",
    "rank-hang",
    "its watchdog ends it with EngineHungError and the stuck stack; then as a death: requests move or fail "
    "typed, the rank restarts",
)
GANG_HANG_ROW = Row(
    f"hang lockstep rank (its loop blocks; step_timeout_s {HANG_STEP_TIMEOUT_S:g} s)",
    "rank-hang",
    "its watchdog ends it, and its peer's (stuck in the DP all-reduce) ends the peer: EngineHungError for both; "
    "in-flight requests fail typed; the gang restarts",
)
GANG_SKIP_ROW = Row(
    f"lockstep rank skips its all-reduces (step_timeout_s {HANG_STEP_TIMEOUT_S:g} s)",
    "rank-skip-allreduce",
    "the skipping rank runs on; its peer waits in the DP all-reduce until its watchdog ends it "
    "(EngineHungError: its peers never joined); in-flight requests fail typed; the gang restarts",
)
WEDGE_STARTUP_TIMEOUT_S = 3.0  # the startup deadline in this row (600 s by default)
WEDGE_ROW = Row(
    f"restart wedges while starting (startup_timeout_s {WEDGE_STARTUP_TIMEOUT_S:g} s)",
    "restart-wedge",
    "the rank is killed; its successor wedges in its constructor, its own startup deadline ends it "
    "(INIT_FAILED, with the stuck stack), and the next try serves; detected is the wedge's report",
)
GANG_ROW = Row(
    "kill lockstep rank (SIGKILL)",
    "rank-sigkill",
    "every rank of the gang reported restarting, in-flight requests fail typed; the gang restarts",
)


_STEP = {"step_delay_s": 0.005}
_GANG = {"lockstep": True, "allreduce_interval": 4}
_HANGS = "raydp.testing.hangs:"
# group -> (cluster name, its row, whether a death restarts the gang, launch fields): the DP=2 clusters.
PAIR_CLUSTERS: dict[str, tuple[str, Row, bool, dict[str, Any]]] = {
    "worker": (
        "fbtp",
        WORKER_ROW,
        False,
        {"tensor_parallel_size": 2, "engine": "raydp.models.echo_workers:WorkerEchoEngine", "engine_kwargs": _STEP},
    ),
    "hang": (
        "fbhang",
        HANG_ROW,
        False,
        {
            "engine": _HANGS + "HangableWorkerEchoEngine",
            "engine_kwargs": _STEP,
            "step_timeout_s": HANG_STEP_TIMEOUT_S,
        },
    ),
    "gang": ("fbgang", GANG_ROW, True, {**_GANG, "engine_kwargs": {"collective": True, **_STEP}}),
    "gang-hang": (
        "fbganghang",
        GANG_HANG_ROW,
        True,
        {
            **_GANG,
            "engine": _HANGS + "HangableEchoEngine",
            "engine_kwargs": {"collective": True, **_STEP},
            "step_timeout_s": HANG_STEP_TIMEOUT_S,
        },
    ),
    "gang-skip": (
        "fbgangskip",
        GANG_SKIP_ROW,
        True,
        {
            **_GANG,
            "engine": _HANGS + "HangableEchoEngine",
            "engine_kwargs": {"collective": True, **_STEP},
            "step_timeout_s": HANG_STEP_TIMEOUT_S,
        },
    ),
    "restart-wedge": (
        "fbwedge",
        WEDGE_ROW,
        False,
        {
            "engine": _HANGS + "HangingEchoEngine",
            "engine_kwargs": {"hang_in": "restart", "ranks": [1], "once_dir": None, **_STEP},  # once_dir: run_rows'
            "startup_timeout_s": WEDGE_STARTUP_TIMEOUT_S,
        },
    ),
}
GROUPS = ("dense", "coordinator-node", *PAIR_CLUSTERS)  # the table's clusters, in its order


def run_rows(trials: int, only: frozenset[str] = frozenset(GROUPS)) -> list[FaultRow]:
    import raydp
    from raydp.serve.settings import ServerSettings

    local = LocalRay((2, 2))
    rows: list[FaultRow] = []
    restarts: dict[str, Any] = {
        "max_restarts": 1000,
        "restart_backoff_s": 0,  # recovery itself, not the policy's backoff
        "coordinator_max_restarts": 1000,
        "progress": False,
    }
    try:
        if "dense" in only:
            with raydp.launch(
                name="fbdense", dp_size=4, dp_size_local=2, engine_kwargs={"step_delay_s": 0.005}, **restarts
            ) as cluster:
                servers = cluster.serve_api(2, settings=ServerSettings(max_restarts=1000))
                for row in DENSE_ROWS:
                    rows.append(measure_row(cluster, local, servers, row, trials))
        if "coordinator-node" in only:
            rows.append(coordinator_node_row(local, trials, restarts))
        for group, (name, row, gang, launch) in PAIR_CLUSTERS.items():
            if group in only:  # two ranks, one per node, as each row's fault wants
                with (
                    tempfile.TemporaryDirectory(prefix="raydp-faults-") as marks,
                    raydp.launch(
                        name=name, dp_size=2, dp_size_local=1, **_with_marks(launch, marks), **restarts
                    ) as cluster,
                ):
                    rows.append(measure_row(cluster, local, None, row, trials, gang=gang))
    finally:
        local.shutdown()
    return rows


def _with_marks(launch: dict[str, Any], marks: str) -> dict[str, Any]:
    """``launch`` with an engine's ``once_dir`` of None pointed at ``marks`` (where a hanging engine counts)."""
    kwargs = launch.get("engine_kwargs", {})
    if "once_dir" not in kwargs:
        return launch
    return {**launch, "engine_kwargs": {**kwargs, "once_dir": marks}}


def coordinator_node_row(local: Any, trials: int, restarts: dict[str, Any]) -> FaultRow:
    """A fresh cluster per trial, rank 0 and the coordinator on a worker node, which is removed."""
    import raydp
    from raydp.serve.settings import ServerSettings

    measured: list[FaultRow] = []
    for trial in range(trials):
        worker = local.worker_nodes()[0].node_id
        with raydp.launch(
            name=f"fbcoord{trial}",
            dp_size=4,
            dp_size_local=2,
            master_node_id=worker,
            engine_kwargs={"step_delay_s": 0.005},
            **restarts,
        ) as cluster:
            servers = cluster.serve_api(2, settings=ServerSettings(max_restarts=1000))
            measured.append(measure_row(cluster, local, servers, COORDINATOR_NODE_ROW, 1))
        if measured[-1].error:
            break
    first = measured[0]
    return dataclasses.replace(
        first,
        detect_s=[d for m in measured for d in m.detect_s],
        back_s=[b for m in measured for b in m.back_s],
        requests=sum(m.requests for m in measured),
        lost=sum(m.lost for m in measured),
        typed=sum(m.typed for m in measured),
        bad=sum(m.bad for m in measured),
        error=next((m.error for m in measured if m.error), ""),
    )


def measure_row(cluster: Any, local: Any, servers: Any, row: Row, trials: int, gang: bool = False) -> FaultRow:
    injector = Injector(cluster, local, servers)
    ledger = Ledger()
    loads: list[Any] = [DriverLoad(cluster.client(), ledger, LoadShape(rate=10, concurrency=4, hung_after_s=30), 1)]
    if servers is not None:
        loads.append(
            HttpLoad(
                servers.url,
                ledger,
                LoadShape(rate=4, concurrency=2, hung_after_s=30),
                2,
                injector.server_killed_between,
            )
        )
    detects: list[float] = []
    backs: list[float] = []
    error = ""
    for load in loads:
        load.start()
    try:
        time.sleep(1.0)
        for trial in range(trials):
            rank = 1 + trial % (cluster.dp_size - 1)  # never rank 0: the probes of the coordinator use it
            fault = injector.inject(row.kind, rank=rank, api_index=trial % 2)
            if gang:
                fault = dataclasses.replace(fault, ranks=tuple(range(cluster.dp_size)))
            detect = wait_for(partial(injector.detected, fault), fault.at, 60.0, 0.005)
            back = wait_for(partial(injector.serving, fault), fault.at, 120.0, 0.015)
            detects.append(math.nan if detect is None else detect)
            backs.append(math.nan if back is None else back)
            log(f"faults: {row.label} #{trial + 1}: {fault.target}: detected {detect}, back {back}")
            if back is None or wait_for(injector.all_serving, time.monotonic(), 120.0, 0.1) is None:
                error = f"not serving again after trial {trial + 1}"
                break
            time.sleep(1.0)
    except Exception as exc:  # a failed measurement is reported, not fatal
        error = repr(exc)[:200]
    finally:
        stuck = sum(load.stop() for load in loads)
    bad = sum(ledger.total(o) for o in ("wrong", "duplicate", "untyped"))
    if bad or ledger.lost() or stuck:
        error = error or f"{ledger.examples[:3]}"
    return FaultRow(
        row.label,
        row.happens,
        detects,
        backs,
        sum(ledger.submitted.values()),
        ledger.lost() + stuck,
        ledger.total("typed"),
        bad,
        error,
    )


def faults_benchmark(trials: int = TRIALS, run: Callable[..., Any] = subprocess.run) -> list[FaultRow]:
    """The rows, measured in a process of its own (it starts its own multi-node Ray)."""
    return rows_from_process("benchmarks.faults.dense", trials, run, timeout=1800)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="print no table (python -m benchmarks prints it)")
    parser.add_argument(
        "--only", nargs="+", choices=GROUPS, default=list(GROUPS), help="the clusters whose rows to measure"
    )
    args = parser.parse_args(argv)
    rows = run_rows(args.trials, frozenset(args.only))
    if not args.quiet:
        print("\n".join(faults_table(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 1 if faults_failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
