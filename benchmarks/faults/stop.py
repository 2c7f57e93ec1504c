"""The failure table's SIGTERM and ``ray job stop`` rows: HTTP requests in flight while ``raydp`` is stopped.

See :mod:`benchmarks.faults.extra` for what each row measures.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.faults.table import REPO, FaultRow, Tally, log
from raydp.testing.http_call import Call as HttpCall
from raydp.testing.leftovers import live_actors, live_groups, socket_dirs, wait_until
from raydp.testing.serve_cli import ServeProcess

GRACE_S = 2.0
LONG = 100_000  # tokens: minutes at 20 ms a step
SLOW_ENGINE = json.dumps({"step_delay_s": 0.02})


class Call(HttpCall):
    """:class:`~raydp.testing.http_call.Call` to ``/v1/completions``, judging how the request ended."""

    def __init__(self, address: tuple[str, int], body: dict[str, Any]) -> None:
        super().__init__(address, "/v1/completions", body)

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
    streams = [Call(address, {"model": name, "prompt": [3 + i], "max_tokens": LONG, "stream": True}) for i in range(2)]
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
                conn.request(
                    "POST",
                    "/v1/completions",
                    json.dumps({"prompt": [1], "max_tokens": 1}),
                    {"Content-Type": "application/json"},
                )
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


def _all_gone(name: str) -> bool:
    """No live actor, placement group or IPC dir of cluster ``name`` (after ``ray job stop``)."""
    return not live_actors(name) and not live_groups(name) and not socket_dirs(name)


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


def sigterm_row(trials: int, backend: str) -> FaultRow:
    import psutil

    label = f"SIGTERM raydp serve ({backend})"
    happens = (
        f"stops accepting (a new connection is refused at once); running requests get "
        f"graceful_shutdown_s={GRACE_S:g} to finish, the rest a 503 or a stream error event; API servers, "
        "engines and IPC dirs go; exit 143"
    )
    tally = Tally()
    on_ray = ["--address", "local", "--accelerator", "CPU", "--dp-size", "1"] if backend == "ray" else []
    for trial in range(trials):
        name = f"fbterm{backend}{trial}"
        flags = ("--backend", backend, "--name", name, "--engine", "echo", "--api-servers", "2", "--port", "0")
        with ServeProcess(
            *flags,
            "--graceful-shutdown-s",
            f"{GRACE_S:g}",
            *on_ray,
            env={"RAYDP_ENGINE_KWARGS": SLOW_ENGINE},
            cwd=str(REPO),
        ) as server:
            try:
                server.banner()
            except AssertionError as exc:
                tally.errors.append(f"#{trial + 1}: {str(exc)[-300:]}")
                continue
            address = server.address
            children = psutil.Process(server.proc.pid).children(recursive=True)
            calls = in_flight(address, name)
            sent: list[float] = []
            probe, refused = refused_probe(address, sent)
            sent.append(time.monotonic())
            code, _, stderr = server.stop(signal.SIGTERM)
            took = time.monotonic() - sent[0]
            probe.join(timeout=10)
        settle(tally, calls, trial)
        tally.detect_s.append(refused[0][0] if refused else math.nan)
        tally.back_s.append(took)
        _, alive = psutil.wait_procs(children, timeout=15)
        left = [p.pid for p in alive if p.name() != "raylet"]  # the local Ray's raylet is Ray's, not raydp's
        if code != 128 + signal.SIGTERM or "everything was shut down" not in stderr:
            tally.errors.append(f"#{trial + 1}: exit {code}: {stderr[-300:]}")
        if left or socket_dirs(name):
            tally.errors.append(f"#{trial + 1}: left behind: processes {left}, dirs {socket_dirs(name)}")
        log(f"{label} #{trial + 1}: refused after {refused}, exit after {took:.2f}s: {[c.outcome() for c in calls]}")
    return tally.row(label, happens)


def job_stop_row(trials: int) -> FaultRow:
    import ray
    from ray.job_submission import JobStatus, JobSubmissionClient

    from raydp.testing.faults import LocalRay

    label = "ray job stop (raydp serve)"
    happens = (
        "SIGTERM to the job's processes: as SIGTERM on raydp serve; the job ends STOPPED with no actor, "
        "placement group or IPC dir left"
    )
    tally = Tally()
    local = LocalRay((2, 2), dashboard=True)  # the Jobs API is the dashboard's
    try:
        jobs = JobSubmissionClient(f"http://{ray._private.worker.global_worker.node.address_info['webui_url']}")
        env = {"PYTHONPATH": str(REPO), "RAY_JOB_STOP_WAIT_TIME_S": "10", "RAYDP_ENGINE_KWARGS": SLOW_ENGINE}
        for trial in range(trials):
            name = f"fbjob{trial}"
            job_id = jobs.submit_job(
                entrypoint=f"{sys.executable} -m raydp serve --name {name} --engine echo --dp-size 2 "
                f"--api-servers 2 --port 0 --graceful-shutdown-s {GRACE_S:g}",
                runtime_env={"env_vars": env},
            )
            deadline = time.monotonic() + 180
            while "Ctrl-C to stop" not in (logs := jobs.get_job_logs(job_id)):
                if time.monotonic() > deadline or jobs.get_job_status(job_id) not in (
                    JobStatus.PENDING,
                    JobStatus.RUNNING,
                ):
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
            gone = wait_until(partial(_all_gone, name), 20)
            final = jobs.get_job_logs(job_id)
            if status != JobStatus.STOPPED or "everything was shut down" not in final:
                tally.errors.append(f"#{trial + 1}: {status}: {final[-300:]}")
            if not gone:
                tally.errors.append(f"#{trial + 1}: left: {live_actors(name)} {live_groups(name)} {socket_dirs(name)}")
            log(
                f"{label} #{trial + 1}: refused after {refused}, STOPPED after {took:.2f}s: "
                f"{[c.outcome() for c in calls]}"
            )
    finally:
        local.shutdown()
    return tally.row(label, happens)


def demo_row(trials: int) -> FaultRow:
    """SIGTERM on ``raydp demo`` while its requests run (a local Ray of its own): exit 143, nothing left."""
    import psutil

    label = "SIGTERM raydp demo"
    happens = "its client's requests are abandoned; cluster, actors, groups, IPC dirs go; exit 143"
    tally = Tally()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAYDP_LOG_LEVEL": "WARNING", "RAYDP_ENGINE_KWARGS": SLOW_ENGINE}
    for trial in range(trials):
        with tempfile.NamedTemporaryFile("w+") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "raydp",
                    "demo",
                    "--address",
                    "local",
                    "--accelerator",
                    "CPU",
                    "--dp-size",
                    "1",
                    "--engine",
                    "echo",
                    "--requests",
                    "5000",
                    "--max-tokens",
                    "1000",
                    "--no-progress",
                ],
                env=env,
                text=True,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
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
