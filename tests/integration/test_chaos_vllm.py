"""The seeded chaos soak on real vLLM engines: each fault kind once, and every answer is the unbroken run's.

Two ranks of vLLM's engine core on the small model, two API servers running
vLLM's own front-end, a driver's load and an HTTP load of greedy requests.
Each prompt was answered once before any fault; every answer during the soak
(a stream that moved to another rank when its rank died or hung included)
must equal that answer, and every request is accounted for. Two minutes, as
the hung-engines issue asks: every kind hits once first (the soak goes on
until it has), then random faults of the same kinds fill the rest; on 2
cores each fault of a vLLM rank costs a vLLM start.
"""

from __future__ import annotations

import pytest

from raydp.testing.chaos_vllm import VLLM_KINDS
from tests.integration.chaos_checks import BRISK, assert_requests_accounted, run_soak
from tests.integration.conftest import ClusterPool
from tests.integration.vllm_helpers import tiny_model


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_a_vllm_chaos_soak_answers_every_request_as_the_unbroken_run(cluster_pool: ClusterPool) -> None:
    cluster_pool.shutdown()  # the soak starts a Ray of its own; on 2 cores the shared one would only slow it down
    args = ["--seed", "11", "--minutes", "2", *BRISK, "--hosts", "vllm", "--model", str(tiny_model())]
    summary = run_soak(args, set(VLLM_KINDS), timeout_s=1100)
    # Every answer equalled the unbroken run's ("wrong" is 0), the streams a fault moved among them.
    assert_requests_accounted(summary, least_ok=30)
    print(f"\nvLLM chaos soak: the driver's client moved {summary['requests']['driver_stream_moves']} streams")
    assert summary["leftovers"] == [], "nothing left after close"
