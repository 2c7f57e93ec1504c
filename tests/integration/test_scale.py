"""Elastic scaling on a 3-node logical-GPU cluster: grow and shrink under load, dense and lockstep.

Load comes from where users send it: the launching process's client, two
API server processes over HTTP (the official ``openai`` SDK), and a client
attached from another process, as a notebook would be. Every request must
complete, or fail with the typed ScaleDownError; none may hang.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import ray

import raydp
from raydp.errors import ClusterClosedError, ConfigError, PlacementError, PlacementTimeoutError, ScaleDownError
from tests.integration.helpers import assert_nothing_left, live_actors, live_groups, wait_until

SHAPE = (2, 2, 2)  # logical GPUs per node: at most 6 ranks of one device
LOAD_LIMIT_S = 300  # every load generator stops by itself after this (the tests stop theirs sooner)
SETTLED_S = 0.1 + 0.3  # after a scale, every client routes by its new size: one snapshot interval and slack


@pytest.fixture(scope="module")
def three_nodes(cluster_pool: Any) -> Any:
    return cluster_pool.get(SHAPE)


@dataclass
class Sent:
    """One request as its sender saw it: when it was sent, where it ran, how it ended."""

    at: float
    rank: int | None
    outcome: str  # "ok", "scaled" (ScaleDownError), or the unexpected error


@dataclass
class Load:
    """A load generator thread; ``log`` is what it saw."""

    stop: threading.Event = field(default_factory=threading.Event)
    log: list[Sent] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def run(self, send: Callable[[], Sent]) -> None:
        def loop() -> None:
            deadline = time.monotonic() + LOAD_LIMIT_S
            while not self.stop.is_set() and time.monotonic() < deadline:
                self.log.append(send())

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        self.threads.append(thread)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a request hung"


def _driver_sender(client: Any) -> Callable[[], Sent]:
    def send() -> Sent:
        at = time.monotonic()
        handle = client.submit([7, 8], max_tokens=4)
        try:
            assert handle.result(timeout=30) == [7, 8, 7, 8]
            return Sent(at, handle.rank, "ok")
        except ScaleDownError:
            return Sent(at, handle.rank, "scaled")
        except Exception as exc:
            return Sent(at, handle.rank, repr(exc))

    return send


def _http_sender(url: str, model: str) -> Callable[[], Sent]:
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)

    def send() -> Sent:
        at = time.monotonic()
        try:
            done = sdk.completions.create(model=model, prompt=[5], max_tokens=3)
        except openai.APIError as exc:
            return Sent(at, None, "scaled" if "scale-down" in str(exc) else repr(exc))
        extra = done.choices[0].model_extra or {}
        ok = done.choices[0].text == "\x05\x05\x05"
        return Sent(at, extra.get("rank"), "ok" if ok else f"wrong text {done.choices[0].text!r}")

    return send


NOTEBOOK = """
import json, sys, time, ray, raydp
from raydp.errors import ScaleDownError
ray.init(address={address!r}, log_to_driver=False)
cluster = raydp.attach({name!r})
client = cluster.client()
out = open({log!r}, "a")
deadline = time.monotonic() + {limit}
print("attached", flush=True)
while time.monotonic() < deadline and not __import__("os").path.exists({stop!r}):
    at = time.time()
    handle = client.submit([3], max_tokens=2)
    try:
        outcome = "ok" if handle.result(timeout=30) == [3, 3] else "wrong"
    except ScaleDownError:
        outcome = "scaled"
    except Exception as exc:
        outcome = repr(exc)
    out.write(json.dumps([at, handle.rank, outcome]) + "\\n")
    out.flush()
cluster.close()
"""


@dataclass
class Notebook:
    proc: subprocess.Popen[str]
    log: Path
    stop: Path

    def sent(self) -> list[Sent]:
        # The notebook stamps wall-clock times; the test's marks are monotonic.
        offset = time.monotonic() - time.time()
        lines = self.log.read_text().split("\n")[:-1]  # the last is "" or a line still being written
        rows = [json.loads(line) for line in lines if line.strip()]
        return [Sent(at + offset, rank, outcome) for at, rank, outcome in rows]


@pytest.fixture
def notebook_factory() -> Iterator[Callable[[str], Notebook]]:
    made: list[Notebook] = []

    def start(name: str) -> Notebook:
        tmp = Path(tempfile.mkdtemp(prefix="raydp-notebook-"))
        log, stop = tmp / "log.jsonl", tmp / "stop"
        script = NOTEBOOK.format(
            address=ray.get_runtime_context().gcs_address, name=name, log=str(log), stop=str(stop), limit=LOAD_LIMIT_S
        )
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "attached"
        nb = Notebook(proc, log, stop)
        made.append(nb)
        return nb

    yield start
    for nb in made:
        nb.stop.touch()
        try:
            nb.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            nb.proc.kill()
        shutil.rmtree(nb.log.parent, ignore_errors=True)


def _first_snapshot(cluster: Any) -> Any:
    client = cluster.client()
    assert wait_until(lambda: client.snapshot() is not None, timeout=5)
    return client.snapshot()


def _routed_after(log: list[Sent], since: float, until: float) -> set[int]:
    return {s.rank for s in log if since <= s.at < until and s.rank is not None}


def _await_routed_to_each(logs: Callable[[], list[list[Sent]]], since: float, size: int) -> float:
    """Wait until each log has a request sent to every rank of ``range(size)`` since ``since``; when it did.

    An event, not a sleep: a sender on a busy machine may take seconds to reach the last new rank.
    """
    want = set(range(size))
    reached = wait_until(lambda: all(_routed_after(log, since, math.inf) >= want for log in logs()), timeout=60)
    assert reached, f"not every sender reached ranks {sorted(want)} within 60s of the scale"
    return time.monotonic()


@pytest.mark.timeout(400)
def test_dense_scale_2_4_1_3_under_load_loses_nothing(
    three_nodes: Any, caplog: pytest.LogCaptureFixture, notebook_factory: Callable[[str], Notebook]
) -> None:
    cluster = raydp.launch(name="scale", dp_size=2, progress=False, engine_kwargs={"step_delay_s": 0.002})
    load = Load()
    try:
        servers = cluster.serve_api(2)
        load.run(_driver_sender(cluster.client()))
        load.run(_driver_sender(cluster.client()))
        load.run(_http_sender(servers.url, "scale"))
        notebook = notebook_factory("scale")
        time.sleep(1.0)
        marks = []
        for size in (4, 1, 3):
            with caplog.at_level(logging.INFO, logger="raydp.manager"):
                cluster.scale(size, drain_timeout_s=20)
            done = time.monotonic()
            assert cluster.dp_size == size and cluster.coordinator_state().dp_size == size
            assert re.search(rf"scaled from \d to {size} ranks in \d+\.\d\ds", caplog.text), "the change is logged"
            end = _await_routed_to_each(lambda: [list(load.log), notebook.sent()], done + SETTLED_S, size)
            marks.append((size, done, end))
        load.finish()
        notebook.stop.touch()
        assert notebook.proc.wait(timeout=60) == 0
        state = cluster.coordinator_state()
        assert (state.dp_size, state.routable, state.dead) == (3, 3, {})
        snap = cluster.client().snapshot() or _first_snapshot(cluster)
        assert (snap.size, len(snap.counts)) == (3, 3), "snapshots carry the size"
    finally:
        load.finish()
        cluster.close()
    for who, log in (
        ("driver", [s for s in load.log if s.rank is not None or s.outcome != "ok"]),
        ("notebook", notebook.sent()),
    ):
        bad = [s for s in log if s.outcome not in ("ok", "scaled")]
        assert not bad, f"{who}: {bad[:5]}"
        assert sum(s.outcome == "ok" for s in log) > 50, f"{who} barely sent anything"
        # The drain timeout was generous: nothing should have been cut off.
        assert not [s for s in log if s.outcome == "scaled"], f"{who}: a request was cut off by a drain"
    for who, log in (("driver", load.log), ("notebook", notebook.sent())):
        for size, done, end in marks:
            # From one snapshot interval after the change, requests go to exactly the new ranks
            # (they finished by `end`; requests still draining on removed ranks were sent before).
            routed = _routed_after(log, done + SETTLED_S, end)
            assert routed == set(range(size)), f"{who} after scaling to {size}: routed to {sorted(routed)}"
    assert_nothing_left("scale", timeout=30)


@pytest.mark.timeout(400)
def test_lockstep_scale_2_4_1_3_re_forms_the_dp_group_at_each_size(
    three_nodes: Any, notebook_factory: Callable[[str], Notebook]
) -> None:
    cluster = raydp.launch(
        name="lsscale",
        dp_size=2,
        lockstep=True,
        progress=False,
        engine_kwargs={"collective": True, "step_delay_s": 0.001},
    )
    load = Load()
    try:
        client = cluster.client()
        servers = cluster.serve_api(2)
        load.run(_driver_sender(client))
        load.run(_driver_sender(cluster.client()))
        load.run(_http_sender(servers.url, "lsscale"))
        notebook = notebook_factory("lsscale")
        for size in (4, 1, 3):
            cluster.scale(size, drain_timeout_s=20)
            done = time.monotonic()
            # Requests arriving during the change waited; new ones run over the new group.
            handles = [client.submit([9], max_tokens=3, rank=r) for r in range(size)]
            assert [h.result(timeout=30) for h in handles] == [[9, 9, 9]] * size
            stats = [client.call_utility(r, "stats") for r in range(size)]
            assert [s["dp_group_size"] for s in stats] == [size] * size, stats
            _await_routed_to_each(lambda: [notebook.sent()], done + SETTLED_S, size)
        load.finish()
        notebook.stop.touch()
        assert notebook.proc.wait(timeout=60) == 0
        before = [client.call_utility(r, "stats")["collectives"] for r in range(3)]
        assert client.generate([1], max_tokens=40) == [1] * 40
        after = [client.call_utility(r, "stats")["collectives"] for r in range(3)]
        assert all(a > b for a, b in zip(after, before, strict=True)), "every rank steps in the collective"
    finally:
        load.finish()
        cluster.close()
    for who, log in (("driver and HTTP", load.log), ("notebook", notebook.sent())):
        bad = [s for s in log if s.outcome != "ok"]
        assert not bad and len(log) > 20, f"{who}: {bad[:5]} of {len(log)}"
    assert {s.rank for s in notebook.sent()} == {0, 1, 2, 3}, "the notebook followed every change"
    assert_nothing_left("lsscale", timeout=30)


@pytest.mark.timeout(200)
def test_a_scale_down_past_its_drain_timeout_fails_what_is_left_with_a_typed_error(three_nodes: Any) -> None:
    with raydp.launch(name="cutoff", dp_size=2, progress=False, engine_kwargs={"step_delay_s": 0.02}) as cluster:
        client = cluster.client()
        long = client.submit([4], max_tokens=100_000, rank=1)
        moved = client.submit([6], max_tokens=2, rank=0)
        assert moved.result(timeout=30) == [6, 6]
        started = time.monotonic()
        cluster.scale(1, drain_timeout_s=0.5)
        assert time.monotonic() - started < 60  # not waiting for the 100,000-token request (2,000 s)
        with pytest.raises(ScaleDownError, match="rank 1 was removed by a scale-down to dp_size=1") as err:
            long.result(timeout=10)
        assert (err.value.rank, err.value.dp_size, err.value.drain_timeout_s) == (1, 1, 0.5)
        assert client.generate([2], max_tokens=2) == [2, 2], "the cluster serves on at its new size"
        assert sorted(live_actors("cutoff")) == ["cutoff-coordinator", "cutoff-dp0"]
        assert live_groups("cutoff") == ["cutoff-dp0"]
    assert_nothing_left("cutoff", timeout=30)


@pytest.mark.timeout(200)
def test_bad_scale_requests_are_refused_and_the_cluster_serves_on(three_nodes: Any) -> None:
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    cluster = raydp.launch(
        name="badscale", dp_size=2, progress=False, node_allowlist=nodes[:2], engine_kwargs={"step_delay_s": 0.02}
    )
    try:
        client = cluster.client()
        for bad, match in ((0, "dp_size=0: must be an int >= 1"), ("3", "dp_size='3'"), (True, "dp_size=True")):
            with pytest.raises(ConfigError, match=match):
                cluster.scale(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="drain_timeout_s=-1"):
            cluster.scale(3, drain_timeout_s=-1)
        started = time.monotonic()
        with pytest.raises(PlacementError, match="allowlisted nodes cannot hold 3 more ranks"):
            cluster.scale(5)  # two nodes of 2 devices can never hold 5
        assert time.monotonic() - started < 45, "no waiting for capacity that can never come (60 s placement timeout)"
        assert sorted(live_groups("badscale")) == ["badscale-dp0", "badscale-dp1"], "nothing half-made"
        long = client.submit([1], max_tokens=200, rank=1)
        shrinking = threading.Thread(target=cluster.scale, args=(1,), kwargs={"drain_timeout_s": 60})
        shrinking.start()
        assert wait_until(lambda: client.dp_size == 1, timeout=10)
        with pytest.raises(ConfigError, match="another scale of cluster 'badscale' is running"):
            cluster.scale(2)
        assert long.result(timeout=60) == [1] * 200, "a draining rank finishes its requests"
        shrinking.join(timeout=60)
        assert cluster.dp_size == 1 and client.generate([5], max_tokens=2) == [5, 5]
    finally:
        cluster.close()
    with pytest.raises(ClusterClosedError):
        cluster.scale(2)
    assert_nothing_left("badscale", timeout=30)


@pytest.mark.timeout(200)
def test_a_scale_up_waits_for_capacity_then_fails_cleanly_or_uses_a_new_node(three_nodes: Any) -> None:
    # The wait must outlast a node's start on a busy 2-core machine (6 s did not, beside another module).
    cluster = raydp.launch(name="pending", dp_size=5, progress=False, placement_timeout_s=20)
    try:
        started = time.monotonic()
        with pytest.raises(PlacementTimeoutError, match="not ready after 20s"):
            cluster.scale(7)  # 6 logical GPUs in all: the 7th rank waits, then gives up
        assert time.monotonic() - started >= 19
        assert len(live_groups("pending")) == 5 and cluster.dp_size == 5, "the pending groups were removed"
        grown = threading.Thread(target=cluster.scale, args=(7,))
        grown.start()
        time.sleep(1.0)
        node = three_nodes.add_node(num_cpus=4, num_gpus=2)  # what an autoscaler would do
        try:
            grown.join(timeout=60)
            assert cluster.dp_size == 7
            client = cluster.client()
            assert client.generate([8], max_tokens=2, rank=6) == [8, 8]
            cluster.scale(5)
        finally:
            three_nodes.remove_node(node)
    finally:
        cluster.close()
    assert_nothing_left("pending", timeout=30)


LAUNCH_DETACHED = """
import ray, raydp
ray.init(address={address!r})
cluster = raydp.launch(name="cliscale", prefill_dp_size=1, decode_dp_size=1, detached=True, progress=False)
print("launched", cluster.dp_size, flush=True)
"""


@pytest.mark.timeout(240)
def test_raydp_scale_grows_and_shrinks_each_pool_of_a_detached_p_d_cluster(three_nodes: Any) -> None:
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RAY_ADDRESS": address}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=150, check=False)

    out = run(sys.executable, "-c", LAUNCH_DETACHED.format(address=address))
    assert out.returncode == 0 and "launched 2" in out.stdout, out.stderr[-3000:]
    try:
        attached = raydp.attach("cliscale")
        client = attached.client()
        # The prefill pool to 2: rank 2 joins as a decode rank, then rank 1 moves to the prefill pool.
        out = run(sys.executable, "-m", "raydp", "scale", "cliscale", "2", "--pool", "prefill")
        assert out.returncode == 0, out.stderr[-3000:]
        assert "cliscale: 2 -> 3 ranks (prefill pool 2)" in out.stdout
        assert sorted(live_actors("cliscale")) == [
            "cliscale-coordinator",
            "cliscale-dp0",
            "cliscale-dp1",
            "cliscale-dp2",
            "cliscale-supervisor",
        ]
        follows = wait_until(lambda: (client.dp_size, client.endpoints.prefill_ranks) == (3, 2), timeout=10)
        assert follows, "an attached client follows both the size and the pools"
        handles = [client.submit([4, k], max_tokens=3) for k in range(6)]
        assert [h.result(30) for h in handles] == [[4, k, 4] for k in range(6)]
        assert {h.rank for h in handles} == {2}, "rank 1 prefills now; the new rank 2 decodes"
        status = run(sys.executable, "-m", "raydp", "status", "cliscale", "--json")
        pools = [r["pool"] for r in json.loads(status.stdout)[0]["ranks"]]
        assert pools == ["prefill", "prefill", "decode"], status.stdout
        out = run(sys.executable, "-m", "raydp", "scale", "cliscale", "1", "--pool", "prefill", "--drain-timeout", "5")
        assert out.returncode == 0, out.stderr[-3000:]
        assert sorted(live_actors("cliscale")) == [
            "cliscale-coordinator",
            "cliscale-dp0",
            "cliscale-dp1",
            "cliscale-supervisor",
        ]
        assert wait_until(lambda: (client.dp_size, client.endpoints.prefill_ranks) == (2, 1), timeout=10)
        again = client.submit([6, 1], max_tokens=3)
        assert again.result(30) == [6, 1, 6] and again.rank == 1, "rank 1 decodes again"
        out = run(sys.executable, "-m", "raydp", "scale", "cliscale", "0")
        assert out.returncode == 2 and "dp_size=0: must be an int >= 1" in out.stderr
        out = run(sys.executable, "-m", "raydp", "scale", "cliscale", "2")
        assert out.returncode == 2 and "pool=None: a P/D cluster scales one pool at a time" in out.stderr
        out = run(sys.executable, "-m", "raydp", "scale", "nosuchcluster", "2")
        assert out.returncode == 2 and "name='nosuchcluster'" in out.stderr
        attached.close()
    finally:
        raydp.attach("cliscale").shutdown()
    assert_nothing_left("cliscale", timeout=30)


@pytest.mark.timeout(200)
def test_a_rank_added_by_a_scale_up_restarts_like_the_others(three_nodes: Any) -> None:
    with raydp.launch(name="grownrestart", dp_size=1, max_restarts=1, progress=False) as cluster:
        cluster.scale(2)
        client = cluster.client()
        assert client.generate([3], max_tokens=2, rank=1) == [3, 3]
        ray.kill(ray.get_actor("grownrestart-dp1", namespace="raydp"))
        assert wait_until(lambda: len(cluster.deaths) == 1, timeout=10)
        assert cluster.deaths[0].rank == 1 and cluster.deaths[0].restarting  # type: ignore[attr-defined]

        def served_by_rank_1() -> bool:
            try:
                return client.generate([5], max_tokens=2, rank=1, timeout=5) == [5, 5]
            except raydp.RaydpError:
                return False

        assert wait_until(served_by_rank_1, timeout=30), "the new rank came back"
        assert cluster.coordinator_state().restarts == [0, 1]
        cluster.scale(1)
        assert cluster.deaths[1:] == [], "a rank removed by a scale-down is not a death"
    assert_nothing_left("grownrestart", timeout=30)
