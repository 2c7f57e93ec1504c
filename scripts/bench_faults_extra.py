"""The failure table's other rows: a partitioned node, SIGTERM on ``raydp serve``, ``ray job stop``.

Run alone as ``.venv/bin/python scripts/bench_faults_extra.py [--trials N] [--only ROW] [--json PATH]``
or as the ``faults-extra`` section of ``scripts/bench.py`` (a process of its
own: each row starts its own Ray). Rows, ``trials`` each (default 5):

* **partition node**: a fresh Ray per trial over network-namespace hosts
  (``tests/integration/netns.py``: a bridge on 10.213.7.0/24, one Ray node per
  namespace with 1 logical GPU, the head in the root namespace with none, Ray's
  health check at 500 ms / 1 s timeout / 3 failures). DP=2 over 3 hosts,
  ``max_restarts=1``: the third host is spare capacity. The host of rank 1
  has its veth brought down. *Detected*: link down to rank 1's
  ``EngineDeadError`` in ``cluster.deaths``. *Back*: link down to a request
  pinned to rank 1 answered, by the rank re-placed on the spare host. Load: a
  driver client's ``retryable`` requests (~6/s, to both ranks). Needs root
  and ``ip netns``; skipped with the reason otherwise.
* **SIGTERM raydp serve** (``--backend mp`` and the Ray backend): two API
  servers, echo engine at 20 ms a step, ``--graceful-shutdown-s 2``; per
  trial 5 HTTP requests in flight (2 plain and 2 streams that cannot end in
  the grace period, 1 short stream that can). *Detected*: SIGTERM to a new
  request refused (503 or connection refused). *Stopped*: SIGTERM to the
  process's exit. Every in-flight request must end whole (a 503 in OpenAI's
  shape or a stream ending in an error event is typed; the short one must
  finish); a reset or cut body is lost. Nothing may be left: no child process,
  no IPC dir for that cluster name.
* **ray job stop**: ``python -m raydp serve`` submitted as a Ray Job to a local
  2-node Ray (``RAY_JOB_STOP_WAIT_TIME_S=10``); 2 requests in flight; *stopped*
  is ``stop_job`` to status STOPPED; then no live actor, placement group or IPC
  dir of that cluster name.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRIALS = 5
ROWS = ("partition", "sigterm-mp", "sigterm-ray", "sigterm-demo", "job-stop")
GRACE_S = 2.0
LONG = 100_000  # tokens: minutes at 20 ms a step
SLOW_ENGINE = json.dumps({"step_delay_s": 0.02})
HEALTH_CHECK = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


@dataclass
class Tally:
    """Per row: the trials' times and the in-flight requests' outcomes."""

    detect_s: list[float] = field(default_factory=list)
    back_s: list[float] = field(default_factory=list)
    requests: int = 0
    lost: int = 0
    typed: int = 0
    bad: int = 0
    errors: list[str] = field(default_factory=list)

    def row(self, label: str, happens: str) -> Any:
        from bench_faults import FaultRow

        return FaultRow(label, happens, self.detect_s, self.back_s, self.requests, self.lost, self.typed, self.bad,
                        "; ".join(self.errors)[:400])


def log(text: str) -> None:
    print(f"[faults-extra] {text}", file=sys.stderr, flush=True)


def nan_if_none(x: float | None) -> float:
    return math.nan if x is None else x


# ---- partition -------------------------------------------------------------------------------------------------


def partition_row(trials: int) -> Any:
    from tests.integration import netns

    label, happens = ("partition node", "its rank is reported dead 'node died' after Ray's health check gives up; "
                      "re-placed on a spare host and restarted")
    tally = Tally()
    reason = netns.unavailable()
    if reason is not None:
        tally.errors.append(f"skipped: {reason}")
        log(f"partition skipped: {reason}")
        return tally.row(label, happens)
    try:
        for trial in range(trials):
            result = _partition_trial(trial)
            log(f"partition #{trial + 1}: {result}")
            tally.detect_s.append(nan_if_none(result.get("detect_s")))
            tally.back_s.append(nan_if_none(result.get("back_s")))
            for key in ("requests", "lost", "typed", "bad"):
                setattr(tally, key, getattr(tally, key) + int(result.get(key, 0)))
            if result.get("error"):
                tally.errors.append(f"#{trial + 1}: {result['error']}")
    finally:
        netns.teardown()
        if netns.leftovers():
            tally.errors.append(f"namespaces left: {netns.leftovers()}")
    return tally.row(label, happens)


def _partition_trial(trial: int) -> dict[str, Any]:
    from tests.integration import netns
    from tests.integration.ray_hosts import Processes, clean_env, free_port

    procs = Processes(Path(tempfile.mkdtemp(prefix=f"{netns.PREFIX}-ray-")))
    out = procs.workdir / "result.json"
    try:
        net = netns.create(3)
        env = clean_env(HEALTH_CHECK)
        port = free_port(net.bridge_ip)
        procs.start_head(net.bridge_ip, port, env)
        for host in net.hosts:
            procs.start_node(host, f"{net.bridge_ip}:{port}", gpus=1, env=env)
        driver = procs.start(
            [sys.executable, str(Path(__file__)), "--partition-driver", "--address", f"{net.bridge_ip}:{port}",
             "--hosts", ",".join(f"{h.ip}={h.link}" for h in net.hosts), "--json", str(out)],
            "driver.log", clean_env({}),
        )
        try:
            driver.wait(timeout=400)
        except subprocess.TimeoutExpired:
            return {"error": f"driver did not finish; log: {procs.log_tail('driver.log', 600)}"}
        if not out.exists():
            return {"error": f"driver exited {driver.returncode}: {procs.log_tail('driver.log', 600)}"}
        result: dict[str, Any] = json.loads(out.read_text())
        return result
    finally:
        procs.stop()
        netns.teardown()
        shutil.rmtree(procs.workdir, ignore_errors=True)
        from raydp.wire.transport import IpcDir

        for path in IpcDir.root().glob("fbpart-*"):  # the driver's own, had it been killed
            shutil.rmtree(path, ignore_errors=True)


def partition_driver(address: str, hosts: list[tuple[str, str]], out: Path) -> None:
    """One trial, in a process that joins the namespace Ray (this bench's process never does)."""
    import ray

    ray.init(address=address, log_to_driver=False)
    result: dict[str, Any] = {}
    try:
        result = _partition_measure(hosts)
    except Exception as exc:
        result = {"error": repr(exc)[:300]}
    finally:
        out.write_text(json.dumps(result))
        ray.shutdown()


def _partition_measure(hosts: list[tuple[str, str]]) -> dict[str, Any]:
    from fault_load import DriverLoad, Ledger, LoadShape
    from faults import wait_for

    import raydp
    from raydp.errors import EngineDeadError
    from tests.integration import netns
    from tests.integration.multihost_driver import node_ids_by_ip

    nodes = node_ids_by_ip([ip for ip, _ in hosts])
    link_of = {nodes[ip]: link for ip, link in hosts}
    cluster = raydp.launch(name="fbpart", dp_size=2, dp_size_local=1, master_node_id=nodes[hosts[0][0]],
                           accelerator="GPU", max_restarts=1, progress=False,
                           engine_kwargs={"step_delay_s": 0.005})
    ledger = Ledger()
    load = DriverLoad(cluster.client(), ledger, LoadShape(rate=6, concurrency=3, hung_after_s=30), 1)
    control = cluster.client()

    def rank1_serves() -> bool:
        try:
            return bool(control.generate([2, 7], max_tokens=2, rank=1, timeout=2.0) == [2, 7])
        except (raydp.RaydpError, TimeoutError):
            return False

    def rank1_dead() -> bool:
        return any(isinstance(e, EngineDeadError) and e.rank == 1 for e in cluster.deaths)

    stuck = 0
    try:
        load.start()
        time.sleep(1.5)
        old_node = cluster.endpoints.engines[1].node_id
        link = link_of[old_node]
        at = time.monotonic()
        netns.partition(netns.Host(0, "", "", link))
        detect = wait_for(rank1_dead, at, 60.0, 0.02)
        back = wait_for(rank1_serves, at, 120.0, 0.05)
        new_node = cluster.endpoints.engines[1].node_id
        time.sleep(1.5)
    finally:
        stuck = load.stop()
    bad = sum(ledger.total(o) for o in ("wrong", "duplicate", "untyped"))
    lost = ledger.lost() + stuck
    error = "" if back is not None else "rank 1 never served again"
    if new_node == old_node:
        error = error or "rank 1 not re-placed"
    if bad or lost:
        error = error or str(ledger.examples[:3])
    with contextlib.suppress(Exception):
        control.close()
    cluster.close()
    return {"detect_s": detect, "back_s": back, "requests": sum(ledger.submitted.values()), "lost": lost,
            "typed": ledger.total("typed"), "bad": bad, "error": error,
            "moved": f"{old_node[:8]} -> {new_node[:8]}", "deaths": [str(e)[:200] for e in cluster.deaths]}


# ---- SIGTERM and ray job stop: in-flight HTTP requests ------------------------------------------------------------


class Call(threading.Thread):
    """One HTTP request on its own connection; ``started`` is set once a stream's first event is in."""

    def __init__(self, address: tuple[str, int], body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.address, self.body = address, body
        self.started = threading.Event()
        self.status: int | None = None
        self.data = b""
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            conn = http.client.HTTPConnection(*self.address, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            if self.body.get("stream"):
                self.data = resp.readline()
                self.started.set()
            self.data += resp.read()  # IncompleteRead if the chunked body is cut off
            conn.close()
        except BaseException as exc:  # a reset or a cut-off body: a lost request
            self.error = exc
        finally:
            self.started.set()

    def outcome(self) -> str:
        """ok (finished), typed (a 503 or a stream's error event in OpenAI's shape), lost, or bad."""
        if self.is_alive() or self.error is not None:
            return "lost"
        if not self.body.get("stream"):
            return "typed" if self.status == 503 and _openai_error(self.data) else "bad"
        events = [e.removeprefix("data: ") for e in self.data.decode(errors="replace").split("\n\n") if e]
        if self.status != 200 or not events:
            return "bad"
        if events[-1] == "[DONE]":
            return "ok"
        return "typed" if _openai_error(events[-1].encode()) else "bad"


def _openai_error(data: bytes) -> bool:
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and {"message", "type"} <= error.keys()


def in_flight(address: tuple[str, int], name: str) -> list[Call]:
    """2 plain and 2 streamed requests that outlast the grace period, and a short stream that ends within it."""
    calls = [Call(address, {"model": name, "prompt": [1 + i], "max_tokens": LONG}) for i in range(2)]
    streams = [Call(address, {"model": name, "prompt": [3 + i], "max_tokens": LONG, "stream": True})
               for i in range(2)]
    for call in streams:
        call.started.wait(30)
    short = Call(address, {"model": name, "prompt": [9], "max_tokens": 30, "stream": True})
    short.started.wait(30)
    return [*calls, *streams, short]


def refused_probe(address: tuple[str, int], sent: list[float]) -> tuple[threading.Thread, list[tuple[float, str]]]:
    """Once ``sent`` holds the signal's time, a tiny request every 20 ms until one is refused.

    The list it returns gets (seconds since the signal, how it was refused).
    """
    found: list[tuple[float, str]] = []

    def loop() -> None:
        deadline = time.monotonic() + 90
        while not sent and time.monotonic() < deadline:
            time.sleep(0.005)
        while time.monotonic() < deadline:
            conn = http.client.HTTPConnection(*address, timeout=30)
            how = ""
            try:
                conn.request("POST", "/v1/completions", json.dumps({"prompt": [1], "max_tokens": 1}),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                how = "503" if resp.status == 503 else ""
            except (OSError, http.client.HTTPException) as exc:
                how = type(exc).__name__
            finally:
                conn.close()
            if how:
                found.append((time.monotonic() - sent[0], how))
                return
            time.sleep(0.02)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread, found


def settle(tally: Tally, calls: list[Call], trial: int) -> None:
    for call in calls:
        call.join(timeout=15)
    outcomes = [c.outcome() for c in calls]
    tally.requests += len(calls)
    tally.lost += outcomes.count("lost")
    tally.typed += outcomes.count("typed")
    tally.bad += outcomes.count("bad")
    if outcomes[-1] != "ok":
        tally.errors.append(f"#{trial + 1}: the short stream did not finish in the grace period ({outcomes[-1]})")
    for call, outcome in zip(calls, outcomes, strict=True):
        if outcome in ("lost", "bad"):
            tally.errors.append(f"#{trial + 1}: {outcome}: {call.status} {call.error!r} {call.data[-200:]!r}")


def sigterm_row(trials: int, backend: str) -> Any:
    import psutil

    from tests.integration.helpers import socket_dirs

    label = f"SIGTERM raydp serve ({backend})"
    happens = (f"stops accepting (a new connection is refused at once); running requests get "
               f"graceful_shutdown_s={GRACE_S:g} to finish, the rest a 503 or a stream error event; API servers, "
               "engines and IPC dirs go; exit 143")
    tally = Tally()
    on_ray = ["--address", "local", "--accelerator", "CPU", "--dp-size", "1"] if backend == "ray" else []
    for trial in range(trials):
        name = f"fbterm{backend}{trial}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAYDP_LOG_LEVEL": "WARNING", "RAYDP_ENGINE_KWARGS": SLOW_ENGINE}
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "raydp", "serve", "--backend", backend, "--name", name, "--engine", "echo",
                 "--api-servers", "2", "--port", "0", "--graceful-shutdown-s", f"{GRACE_S:g}", *on_ray],
                env=env, text=True, stdout=subprocess.PIPE, stderr=err, cwd=REPO)
            try:
                assert proc.stdout is not None
                banner = proc.stdout.readline()
                if "Ctrl-C to stop" not in banner:
                    proc.wait(timeout=30)
                    err.seek(0)
                    tally.errors.append(f"#{trial + 1}: no banner: {err.read()[-300:]}")
                    continue
                host, port = banner.split(" at http://")[1].split(" ")[0].split(":")
                address = (host, int(port))
                children = psutil.Process(proc.pid).children(recursive=True)
                calls = in_flight(address, name)
                sent: list[float] = []
                probe, refused = refused_probe(address, sent)
                sent.append(time.monotonic())
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
                took = time.monotonic() - sent[0]
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            probe.join(timeout=10)
            err.seek(0)
            stderr = err.read()
        settle(tally, calls, trial)
        tally.detect_s.append(refused[0][0] if refused else math.nan)
        tally.back_s.append(took)
        _, alive = psutil.wait_procs(children, timeout=15)
        left = [p.pid for p in alive if p.name() != "raylet"]  # the local Ray's raylet is Ray's, not raydp's
        if proc.returncode != 128 + signal.SIGTERM or "everything was shut down" not in stderr:
            tally.errors.append(f"#{trial + 1}: exit {proc.returncode}: {stderr[-300:]}")
        if left or socket_dirs(name):
            tally.errors.append(f"#{trial + 1}: left behind: processes {left}, dirs {socket_dirs(name)}")
        log(f"{label} #{trial + 1}: refused after {refused}, exit after {took:.2f}s: "
            f"{[c.outcome() for c in calls]}")
    return tally.row(label, happens)


def job_stop_row(trials: int) -> Any:
    import ray
    from faults import LocalRay
    from ray.job_submission import JobStatus, JobSubmissionClient

    from tests.integration.helpers import live_actors, live_groups, socket_dirs, wait_until

    label = "ray job stop (raydp serve)"
    happens = ("SIGTERM to the job's processes: as SIGTERM on raydp serve; the job ends STOPPED with no actor, "
               "placement group or IPC dir left")
    tally = Tally()
    local = LocalRay((2, 2))
    try:
        jobs = JobSubmissionClient(f"http://{ray._private.worker.global_worker.node.address_info['webui_url']}")
        env = {"PYTHONPATH": str(REPO), "RAY_JOB_STOP_WAIT_TIME_S": "10", "RAYDP_ENGINE_KWARGS": SLOW_ENGINE}
        for trial in range(trials):
            name = f"fbjob{trial}"
            job_id = jobs.submit_job(
                entrypoint=f"{sys.executable} -m raydp serve --name {name} --engine echo --dp-size 2 "
                f"--api-servers 2 --port 0 --graceful-shutdown-s {GRACE_S:g}",
                runtime_env={"env_vars": env})
            deadline = time.monotonic() + 180
            while "Ctrl-C to stop" not in (logs := jobs.get_job_logs(job_id)):
                if time.monotonic() > deadline or jobs.get_job_status(job_id) not in (JobStatus.PENDING,
                                                                                     JobStatus.RUNNING):
                    break
                time.sleep(0.3)
            if "Ctrl-C to stop" not in logs:
                tally.errors.append(f"#{trial + 1}: never served: {logs[-300:]}")
                jobs.stop_job(job_id)
                continue
            host, port = logs.split(" at http://")[1].split(" ")[0].split(":")
            address = (host, int(port))
            calls = in_flight(address, name)
            sent: list[float] = []
            probe, refused = refused_probe(address, sent)
            sent.append(time.monotonic())
            jobs.stop_job(job_id)
            while jobs.get_job_status(job_id) != JobStatus.STOPPED and time.monotonic() - sent[0] < 60:
                time.sleep(0.05)
            took = time.monotonic() - sent[0]
            probe.join(timeout=10)
            settle(tally, calls, trial)
            tally.detect_s.append(refused[0][0] if refused else math.nan)
            status = jobs.get_job_status(job_id)
            tally.back_s.append(took if status == JobStatus.STOPPED else math.nan)
            gone = wait_until(lambda n=name: not live_actors(n) and not live_groups(n) and not socket_dirs(n), 20)
            final = jobs.get_job_logs(job_id)
            if status != JobStatus.STOPPED or "everything was shut down" not in final:
                tally.errors.append(f"#{trial + 1}: {status}: {final[-300:]}")
            if not gone:
                tally.errors.append(f"#{trial + 1}: left: {live_actors(name)} {live_groups(name)} "
                                    f"{socket_dirs(name)}")
            log(f"{label} #{trial + 1}: refused after {refused}, STOPPED after {took:.2f}s: "
                f"{[c.outcome() for c in calls]}")
    finally:
        local.shutdown()
    return tally.row(label, happens)


def demo_row(trials: int) -> Any:
    """SIGTERM on ``raydp demo`` while its requests run (a local Ray of its own): exit 143, nothing left."""
    import psutil

    from tests.integration.helpers import socket_dirs

    label = "SIGTERM raydp demo"
    happens = "its client's requests are abandoned; cluster, actors, groups, IPC dirs go; exit 143"
    tally = Tally()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAYDP_LOG_LEVEL": "WARNING", "RAYDP_ENGINE_KWARGS": SLOW_ENGINE}
    for trial in range(trials):
        with tempfile.NamedTemporaryFile("w+") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "raydp", "demo", "--address", "local", "--accelerator", "CPU", "--dp-size", "1",
                 "--engine", "echo", "--requests", "5000", "--max-tokens", "1000", "--no-progress"],
                env=env, text=True, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
            try:
                deadline = time.monotonic() + 120
                while "launched 1 ranks" not in Path(out.name).read_text() and proc.poll() is None:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                children = psutil.Process(proc.pid).children(recursive=True)
                time.sleep(1.0)  # its requests are running
                sent = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
                took = time.monotonic() - sent
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            text = Path(out.name).read_text()
        tally.detect_s.append(math.nan)
        tally.back_s.append(took)
        _, alive = psutil.wait_procs(children, timeout=15)
        left = [p.pid for p in alive if p.name() != "raylet"]
        if proc.returncode != 128 + signal.SIGTERM or "everything was shut down" not in text:
            tally.errors.append(f"#{trial + 1}: exit {proc.returncode}: {text[-300:]}")
        if left or socket_dirs("demo"):
            tally.errors.append(f"#{trial + 1}: left behind: processes {left}, dirs {socket_dirs('demo')}")
        log(f"{label} #{trial + 1}: exit {proc.returncode} after {took:.2f}s")
    return tally.row(label, happens)


def extra_table(rows: list[Any]) -> list[str]:
    """:func:`bench_faults.faults_table`, with what these rows measure in place of its load line."""
    from bench_faults import faults_table

    lines = faults_table(rows)
    lines[0] = "### Failures: partition, SIGTERM, ray job stop"
    lines[2] = ("Medians of the trials (min-max in brackets). Partition: driver ~6 req/s (retryable); detected = link "
                "down to the rank's death report, serving again = to the rank re-placed and answering. SIGTERM and "
                "ray job stop: 5 HTTP requests in flight per trial; detected = the signal to a new request refused "
                "or reset, the next column = to the process's exit (STOPPED for a job).")
    lines[-1] = "Lost must be 0; typed are the in-flight requests answered with a 503 or a stream error event."
    return lines


# ---- entry points ------------------------------------------------------------------------------------------------


def run_rows(trials: int, only: list[str]) -> list[Any]:
    rows = []
    for name in only:
        try:
            if name == "partition":
                rows.append(partition_row(trials))
            elif name == "sigterm-mp":
                rows.append(sigterm_row(trials, "mp"))
            elif name == "sigterm-ray":
                rows.append(sigterm_row(trials, "ray"))
            elif name == "sigterm-demo":
                rows.append(demo_row(trials))
            elif name == "job-stop":
                rows.append(job_stop_row(trials))
        except Exception as exc:  # a failed row is reported, not fatal
            from bench_faults import FaultRow

            rows.append(FaultRow(name, "", [], [], error=repr(exc)[:300]))
    return rows


def extra_benchmark(trials: int = TRIALS, run: Callable[..., Any] = subprocess.run) -> list[Any]:
    """The rows, measured in a process of its own (each row starts its own Ray)."""
    from bench_faults import FaultRow

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = run([sys.executable, str(Path(__file__)), "--trials", str(trials), "--json", out.name, "--quiet"],
                   check=False, timeout=3600)
        text = Path(out.name).read_text()
    if proc.returncode not in (0, 1) or not text:
        return [FaultRow("all", "", [], [], error=f"bench_faults_extra exited {proc.returncode}")]
    return [FaultRow(**row) for row in json.loads(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--only", action="append", choices=ROWS, help="measure only this row (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="print no table (bench.py prints it)")
    parser.add_argument("--partition-driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--hosts", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO)]
    if args.partition_driver:
        hosts = [(h.split("=")[0], h.split("=")[1]) for h in args.hosts.split(",")]
        partition_driver(args.address, hosts, Path(args.json))
        return 0
    from bench_faults import faults_failed

    rows = run_rows(args.trials, args.only or list(ROWS))
    if not args.quiet:
        print("\n".join(extra_table(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 1 if faults_failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
