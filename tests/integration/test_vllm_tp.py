"""vLLM with tensor parallelism inside a raydp rank: vLLM's workers in raydp's device workers.

TP=2 over gloo on CPU bundles gives TP=1's tokens (vLLM's offline ``LLM`` at
TP=1 is the reference), on Ray and on the mp backend; a killed vLLM worker
fails its rank typed, naming the worker, and so does a killed fork server
(the mp backend's workers fork from one in the rank). Neither leaves vLLM's
shared memory behind. (That a dense restart brings a rank back with new
workers is ``test_workers.py``'s, on the reference engines: a vLLM rank's
restart, with ``test_vllm_engine.py``'s, would only add two more vLLM starts
here.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

import raydp
from raydp import Sampling
from raydp.errors import EngineDeadError
from tests.integration.conftest import ClusterPool
from tests.integration.helpers import assert_nothing_left, running, socket_dirs, wait_until
from tests.integration.vllm_helpers import ENGINE_KWARGS, tiny_model, vllm_reference, want_reference

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 10]
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 99, "max_tokens": 10}


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


REFERENCE = want_reference([(p, {"temperature": 0.0, "max_tokens": 10}) for p in PROMPTS] + [(PROMPTS[0], SEEDED)])


@pytest.fixture(scope="module")
def reference(model: str) -> list[list[int]]:
    return vllm_reference(Path(model), REFERENCE)


def _answers(cluster: raydp.Cluster) -> list[list[int]]:
    client = cluster.client()
    handles = [client.submit(p, 10) for p in PROMPTS]
    seeded = client.submit(PROMPTS[0], 10, sampling=Sampling(temperature=0.8, top_p=0.95, seed=99))
    return [h.result(120) for h in [*handles, seeded]]


def test_tp2_on_ray_gives_tp1s_tokens_and_a_killed_worker_fails_its_rank_typed(
    cluster_pool: ClusterPool, model: str, reference: list[list[int]]
) -> None:
    cluster_pool.get((0,), cpus_per_node=4)
    shm_before = _shared_memory()
    with raydp.launch(
        name="vllmtp",
        dp_size=1,
        tensor_parallel_size=2,
        accelerator="CPU",
        max_restarts=0,
        engine="raydp.models.vllm:VllmTPEngine",
        engine_kwargs={"model": model, **ENGINE_KWARGS},
        # Three processes (the rank and its two workers) import vLLM at once, on two cores the other xdist
        # worker shares: a clean run starts in ~40 s, and a busy machine's start must not read as a wedge.
        startup_timeout_s=240,
        progress=False,
    ) as cluster:
        assert _answers(cluster) == reference
        client = cluster.client()
        workers = client.call_utility(0, "raydp_workers")
        assert [w["tp_rank"] for w in workers] == [0, 1] and len({w["pid"] for w in workers}) == 2
        pending = client.submit(PROMPTS[1], 400, sampling=Sampling(ignore_eos=True))
        assert wait_until(lambda: len(pending.tokens) > 0, timeout=60)
        os.kill(workers[1]["pid"], signal.SIGKILL)
        # The rank fails its requests as it goes down (a RequestError carrying the WorkerDeadError), or the
        # client learns of the death first (EngineDeadError): typed either way, naming the rank and worker.
        with pytest.raises((EngineDeadError, raydp.RequestError)) as info:
            pending.result(60)
        assert "rank 0" in str(info.value) and "tp1" in str(info.value), str(info.value)
    assert_nothing_left("vllmtp")
    assert _shared_memory() - shm_before == set(), "the killed group's segments went with its processes"


def test_tp2_on_the_mp_backend_gives_tp1s_tokens_and_its_killed_fork_server_fails_the_rank_typed(
    model: str, reference: list[list[int]]
) -> None:
    shm_before = _shared_memory()
    with raydp.launch(
        name="vllmtpmp",
        dp_size=1,
        tensor_parallel_size=2,
        accelerator="CPU",
        backend="mp",
        max_restarts=0,
        engine="raydp.models.vllm:VllmTPEngine",
        engine_kwargs={"model": model, **ENGINE_KWARGS},
        progress=False,
    ) as cluster:
        assert _answers(cluster) == reference
        client = cluster.client()
        workers = [psutil.Process(w["pid"]) for w in client.call_utility(0, "raydp_workers")]
        # The rank forks its workers from a fork server of its own, which imported vLLM once for both.
        [server] = {w.parent() for w in workers}
        assert "multiprocessing.forkserver" in " ".join(server.cmdline())
        pending = client.submit(PROMPTS[1], 400, sampling=Sampling(ignore_eos=True))
        assert wait_until(lambda: len(pending.tokens) > 0, timeout=60)
        # Killed alone, the server makes both workers look exited (code 255) while they run on: the rank
        # kills them, and its death says why.
        server.kill()
        with pytest.raises((EngineDeadError, raydp.RequestError)) as info:
            pending.result(60)
        assert "rank 0" in str(info.value) and "fork server died" in str(info.value), str(info.value)
        assert wait_until(lambda: not any(running(w.pid) for w in workers), timeout=30), "no worker serves on"
    assert socket_dirs("vllmtpmp") == []
    assert _shared_memory() - shm_before == set()


def _shared_memory() -> set[str]:
    """vLLM's named segments on this host: its CPU TP groups' and its queues' (multiprocessing's psm_)."""
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(("raydp-", "psm_"))}
