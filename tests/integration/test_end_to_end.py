"""DP=2 end to end on two nodes of 4 logical GPUs; close() leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

import raydp
from tests.integration.helpers import assert_nothing_left, live_actors, live_groups, running, socket_dirs, wait_until


@pytest.mark.timeout(180)
def test_dp2_serves_requests_and_close_leaves_nothing(two_nodes) -> None:  # type: ignore[no-untyped-def]
    cluster = raydp.launch(
        name="e2e",
        dp_size=2,
        engine="raydp.models.tiny_lm:TinyLMEngine",
        engine_kwargs={"max_running": 16, "max_len": 64},
        progress=False,
    )
    try:
        assert cluster.dp_size == 2
        assert cluster.capacity == 2 * 16 * 64, "the handshake sums each rank's capacity"
        client = cluster.client()
        handles = [client.submit([1, 2, 3, i % 200], max_tokens=8) for i in range(200)]
        results = [h.result(timeout=60) for h in handles]
        assert all(len(r) == 8 for r in results)
        served = {h.rank for h in handles}
        assert served == {0, 1}, f"both ranks should serve, got {served}"
        # Same prompt, same seeded model on every rank: identical greedy output,
        # so batching many requests together mixed nothing up.
        for i in (0, 1, 57, 199):
            other = 1 - handles[i].rank
            assert client.generate([1, 2, 3, i % 200], max_tokens=8, rank=other) == results[i], i
        assert sorted(live_actors("e2e")) == ["e2e-coordinator", "e2e-dp0", "e2e-dp1"]
        assert sorted(live_groups("e2e")) == ["e2e-dp0", "e2e-dp1"]
    finally:
        cluster.close()
    assert_nothing_left("e2e")
    with pytest.raises(raydp.ClusterClosedError):
        cluster.client()
    cluster.close()  # idempotent
    assert ray.is_initialized()


@pytest.mark.timeout(180)
def test_each_rank_sees_only_its_own_devices(two_nodes) -> None:  # type: ignore[no-untyped-def]
    with raydp.launch(name="devices", dp_size=4, tensor_parallel_size=2, progress=False) as cluster:
        client = cluster.client()
        seen = [client.call_utility(rank, "describe") for rank in range(4)]
    by_node: dict[str, list[str]] = {}
    for info in seen:
        assert len(info["device_ids"]) == 2, info
        assert info["cuda_visible_devices"] == ",".join(info["device_ids"])
        by_node.setdefault(info["node_id"], []).extend(info["device_ids"])
    for node, devices in by_node.items():
        assert len(devices) == len(set(devices)), f"ranks on node {node[:8]} share devices: {devices}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["ray", "mp"])
def test_dropping_the_last_handle_closes_the_cluster(backend: str, request: pytest.FixtureRequest) -> None:
    import gc

    if backend == "ray":
        request.getfixturevalue("two_nodes")
    name = f"orphan-{backend}"
    cluster = raydp.launch(name=name, dp_size=2, backend=backend, progress=False)
    client = cluster.client()
    closer = client.closer
    # What the cluster's own threads hold while they work: a silence watch mid-round holds the controls.
    # They must not keep the handle alive, or a dropped cluster closes at some later collection, anywhere.
    mid_round = cluster._manager.orchestrator.controls
    pids = [client.call_utility(rank, "describe")["pid"] for rank in (0, 1)]
    del cluster
    gc.collect()
    # A client keeps the handle that made it: `raydp.launch(...).client()` serves.
    assert client.generate([1], max_tokens=1, timeout=30) == [1]
    del client
    gc.collect()
    if backend == "ray":
        assert_nothing_left(name, timeout=30, wait_sockets=True)
    else:
        assert wait_until(lambda: not any(running(pid) for pid in pids), timeout=30), "the ranks ended"
    assert closer.__self__.closed, "the cluster's finalizer closes its clients"
    assert mid_round.closing(), "the cluster was closed while its controls were held"


EXITING_DRIVER = """
import raydp
cluster = raydp.launch(name="atexit", dp_size=2, progress=False)
assert cluster.client().generate([1], max_tokens=2, timeout=60) == [1, 1]
print("served", flush=True)
"""  # and exits with the cluster open: no close(), no with-block


@pytest.mark.timeout(180)
def test_a_driver_that_exits_without_close_leaves_nothing(two_nodes) -> None:  # type: ignore[no-untyped-def]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "RAY_ADDRESS": two_nodes.address, "PYTHONPATH": str(repo)}
    out = subprocess.run(
        [sys.executable, "-c", EXITING_DRIVER], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "served" in out.stdout
    assert_nothing_left("atexit", timeout=30, wait_sockets=True)


@pytest.mark.timeout(180)
def test_an_engine_class_defined_in_a_notebook_cell_runs(two_nodes) -> None:  # type: ignore[no-untyped-def]
    from raydp.models.echo import EchoEngine

    class ShoutingEngine(EchoEngine):  # not importable by path, like a notebook class
        def step(self):  # type: ignore[no-untyped-def]
            return [
                type(o)(o.request_id, [t * 10 for t in o.token_ids], o.finished, o.finish_reason)
                for o in super().step()
            ]

    with raydp.launch(name="cell", dp_size=2, engine=ShoutingEngine, progress=False) as cluster:
        assert cluster.client().generate([1, 2], max_tokens=2, timeout=60) == [10, 20]


@pytest.mark.timeout(60)
def test_a_class_that_is_not_an_engine_is_rejected_before_anything_starts(two_nodes) -> None:  # type: ignore[no-untyped-def]
    class NotAnEngine:
        def step(self) -> None: ...

    from ray.util.placement_group import placement_group_table

    with pytest.raises(raydp.ConfigError, match=r"missing .*add_request"):
        raydp.launch(name="notengine", dp_size=1, engine=NotAnEngine, progress=False)
    assert live_actors("notengine") == []
    assert not [g for g in placement_group_table().values() if g["name"].startswith("notengine-")]
    assert socket_dirs("notengine") == []


@pytest.mark.timeout(180)
def test_engine_processes_are_titled_with_rank_and_node(two_nodes) -> None:  # type: ignore[no-untyped-def]
    import psutil

    with raydp.launch(name="titles", dp_size=2, progress=False) as cluster:
        client = cluster.client()
        for rank in range(2):
            info = client.call_utility(rank, "describe")
            title = " ".join(psutil.Process(info["pid"]).cmdline()).strip()
            assert title.startswith(f"raydp::titles dp{rank} lr{rank} node {info['node_id'][:8]}"), title


@pytest.mark.timeout(180)
def test_user_placement_groups_are_used_and_left_to_their_owner(two_nodes) -> None:  # type: ignore[no-untyped-def]
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    groups = [placement_group([{"GPU": 1}, {"CPU": 1}], strategy="STRICT_PACK") for _ in range(2)]
    try:
        assert all(g.wait(30) for g in groups)
        with pytest.raises(raydp.ConfigError, match="placement_groups"):
            raydp.launch(name="usergroups", dp_size=3, placement_groups=groups, progress=False)
        with raydp.launch(name="usergroups", dp_size=2, placement_groups=groups, progress=False) as cluster:
            client = cluster.client()
            nodes = [client.call_utility(r, "describe")["node_id"] for r in range(2)]
            assert nodes == [placement_group_table(g)["bundles_to_node_id"][1] for g in groups]
        # raydp did not create them, so it does not remove them.
        assert [placement_group_table(g)["state"] for g in groups] == ["CREATED", "CREATED"]
    finally:
        for g in groups:
            remove_placement_group(g)


@pytest.mark.timeout(180)
def test_api_servers_on_the_nodes_keep_a_dropped_cluster_and_all_go_once_they_are_dropped(two_nodes) -> None:  # type: ignore[no-untyped-def]
    import gc
    import json
    import urllib.request

    cluster = raydp.launch(name="apidrop", dp_size=2, progress=False)
    groups = cluster.serve_api_per_node(1)
    del cluster
    gc.collect()
    body = json.dumps({"prompt_token_ids": [4], "max_tokens": 2}).encode()
    for group in groups:  # serving servers keep their cluster, as a client does
        request = urllib.request.Request(f"{group.url}/v1/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert json.loads(answer.read()) == {"token_ids": [4, 4]}
    assert any("-api-" in actor for actor in live_actors("apidrop")), "the servers' host actors run"
    del groups, group
    gc.collect()
    assert_nothing_left("apidrop", timeout=60, wait_sockets=True)  # host actors, engines, coordinator
