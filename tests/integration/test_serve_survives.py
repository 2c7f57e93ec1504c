"""A default ``raydp serve`` survives its ranks: a dead rank restarts under load, one past its budget
leaves the service degraded (and saying so), and ``--fail-stop`` stops at the first death."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from raydp.testing.serve_cli import ServeProcess
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.timeout(180)
ENGINE_ENV = {"RAYDP_ENGINE_KWARGS": json.dumps({"step_delay_s": 0.005})}


def serve(name: str, *flags: str) -> ServeProcess:
    common = ("--backend", "mp", "--engine", "echo", "--dp-size", "2", "--port", "0", "--name", name)
    return ServeProcess(*common, *flags, env=ENGINE_ENV)


class Load:
    """Two threads sending small completions through the official SDK, every outcome recorded."""

    def __init__(self, url: str, model: str) -> None:
        self.outcomes: list[str] = []
        self.stop = threading.Event()
        self.sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        self.model = model
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                answer = self.sdk.completions.create(model=self.model, prompt=[5], max_tokens=4)
                ok = answer.usage is not None and answer.usage.completion_tokens == 4
                self.outcomes.append("ok" if ok else f"short: {answer}")
            except openai.APIStatusError as exc:  # answered, with an error
                self.outcomes.append(f"status {exc.status_code}")
            except openai.APIConnectionError as exc:  # not answered at all
                self.outcomes.append(f"refused: {exc!r}")

    def ok_since(self, start: int) -> int:
        return sum(o == "ok" for o in self.outcomes[start:])


@contextmanager
def load(url: str, model: str) -> Iterator[Load]:
    running = Load(url, model)
    for thread in running.threads:
        thread.start()
    try:
        yield running
    finally:
        running.stop.set()
        for thread in running.threads:
            thread.join(timeout=40)


def new_pid(server: ServeProcess, name: str, rank: int, old: int) -> bool:
    try:
        return server.rank_pid(name, rank) != old
    except AssertionError:  # between the two processes
        return False


def ready(server: ServeProcess) -> tuple[int, dict[str, object]]:
    status, body = server.get("/ready")
    assert isinstance(body, dict), body
    return status, body


def test_a_default_serve_restarts_a_killed_rank_and_never_stops_answering() -> None:
    with serve("survive") as server:
        server.banner()
        assert ready(server)[1]["status"] == "ready"
        with load(server.url, "survive") as running:
            assert wait_until(lambda: running.ok_since(0) >= 10, timeout=30)
            old = server.kill_rank("survive", 1)
            killed_at = len(running.outcomes)
            # Restarted by default: a new process, and /ready sees both ranks generate again.
            assert wait_until(lambda: new_pid(server, "survive", 1, old), timeout=60)
            assert wait_until(lambda: ready(server)[1]["status"] == "ready", timeout=60), ready(server)
            assert wait_until(lambda: running.ok_since(killed_at) >= 20, timeout=30)
        refused = [o for o in running.outcomes if o.startswith("refused")]
        failed = [o for o in running.outcomes if o != "ok"]
        assert not refused, refused[:3]
        # Each load thread had at most one request on the rank when it died.
        assert len(failed) <= 2, failed
        _, _, err = server.stop()
    assert "restarting it" in err, err[-2000:]
    assert "stopped by SIGINT; everything was shut down" in err and "Traceback" not in err, err[-2000:]


def test_a_rank_past_its_budget_leaves_the_service_degraded_then_the_last_rank_ends_it() -> None:
    with serve("degraded", "--max-restarts", "1") as server:
        server.banner()
        with load(server.url, "degraded") as running:
            assert wait_until(lambda: running.ok_since(0) >= 5, timeout=30)
            old = server.kill_rank("degraded", 1)
            assert wait_until(lambda: new_pid(server, "degraded", 1, old), timeout=60)
            assert wait_until(lambda: ready(server)[1]["status"] == "ready", timeout=60), "the restart came back"
            server.kill_rank("degraded", 1)  # the budget is spent: rank 1 stays down
            assert wait_until(lambda: ready(server)[1]["status"] == "degraded", timeout=30), ready(server)
            after = len(running.outcomes)
            assert wait_until(lambda: running.ok_since(after) >= 20, timeout=30), "rank 0 serves on"
        status, body = ready(server)
        assert status == 200 and body["generating"] == 1, body
        assert str(body["ranks"]["1"]).startswith("dead"), body  # type: ignore[index]
        _, metrics = server.get("/metrics")
        assert 'raydp_rank_dead{rank="1"} 1.0' in str(metrics)
        assert server.proc.poll() is None, "still serving"
        # The last rank's final death ends the service, naming it (rank 0 still has its one restart).
        old = server.kill_rank("degraded", 0)
        assert wait_until(lambda: new_pid(server, "degraded", 0, old), timeout=60)
        server.kill_rank("degraded", 0)
        server.proc.wait(timeout=30)
        code, out, err = server.stop()
    assert "serving degraded on 1 of 2 ranks" in out, out
    assert code != 0 and "rank 0" in err, err[-2000:]


def test_fail_stop_ends_the_service_at_the_first_death() -> None:
    with serve("failstop", "--fail-stop") as server:
        server.banner()
        started = time.monotonic()
        server.kill_rank("failstop", 1)
        server.proc.wait(timeout=30)
        ended = time.monotonic() - started  # the serve ended by itself, within proc.wait's 30 s
        code, _, err = server.stop()
    assert code != 0 and "rank 1" in err, err[-2000:]
    assert ended < 30


def test_a_start_that_wedges_is_tried_again_and_then_serves(tmp_path: Path) -> None:
    # Rank 1's first engine wedges in its constructor (once: a marker in tmp_path); the second start serves.
    kwargs = {"hang_in": "startup", "ranks": [1], "once_dir": str(tmp_path), "step_delay_s": 0.005}
    flags = ("--backend", "mp", "--engine", "raydp.testing.hangs:HangingEchoEngine", "--dp-size", "2")
    with ServeProcess(
        *flags,
        *("--startup-timeout-s", "3", "--port", "0", "--name", "wedged-serve"),
        env={"RAYDP_ENGINE_KWARGS": json.dumps(kwargs)},
    ) as server:
        server.banner()
        (retry,) = server.retries
        assert "engine rank 1" in retry and "startup_timeout_s=3" in retry, retry
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
        for _ in range(4):  # both ranks (least-loaded spreads them)
            answer = sdk.completions.create(model="wedged-serve", prompt=[5], max_tokens=4)
            assert answer.usage is not None and answer.usage.completion_tokens == 4
        assert "block_forever" in server.stderr(), "the wedged start's stack was logged"
