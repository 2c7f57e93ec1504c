"""vLLM engine cores in lockstep (expert-parallel) mode: waves, vLLM's dummy batch, vLLM's tokens.

vLLM makes the engine process's default torch.distributed group its own
(world size 1, for its workers); raydp's DP group then stands beside it. mp
backend: the wave logic is the same on Ray, and no Ray cluster is needed.
"""

from __future__ import annotations

import pytest

import raydp
from tests.integration.helpers import socket_dirs, wait_until
from tests.integration.vllm_helpers import ENGINE_KWARGS, tiny_model, vllm_reference, want_reference

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PROMPT = [5, 6, 7, 8, 9]
REFERENCE = want_reference([(PROMPT, {"temperature": 0.0, "max_tokens": 24})])


def test_lockstep_vllm_ranks_step_together_with_dummy_batches_and_answer_vllms_tokens() -> None:
    model = tiny_model()
    [expected] = vllm_reference(model, REFERENCE)
    with raydp.launch(
        name="vllmlock",
        dp_size=2,
        lockstep=True,
        accelerator="CPU",
        backend="mp",
        engine="raydp.models.vllm:VllmEngine",
        engine_kwargs={"model": str(model), **ENGINE_KWARGS},
        progress=False,
    ) as cluster:
        client = cluster.client()
        assert client.generate(PROMPT, 24, rank=0, timeout=120) == expected
        assert client.call_utility(1, "stats")["dummy_batches"] > 0, "the idle rank joined the wave's steps"
        assert client.generate(PROMPT, 24, rank=1, timeout=120) == expected
        handles = [client.submit(PROMPT, 24) for _ in range(6)]
        assert [h.result(120) for h in handles] == [expected] * 6
        assert wait_until(lambda: client.snapshot() is not None and not client.snapshot().running, timeout=30), (
            "the wave ends once no rank has work"
        )
    assert socket_dirs("vllmlock") == []
