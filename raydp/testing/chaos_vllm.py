"""The chaos soak's vLLM mode (``--hosts vllm``): real vLLM engine cores on the small model.

Two ranks of :class:`~raydp.testing.hangs.HangableVllmEngine` (vLLM's engine
core, plus a hang on demand) on the local Ray, with API servers running
vLLM's own front-end. Before any fault, each prompt of a seeded pool is
answered greedily once (:func:`unbroken_answers`); every answer during the
soak, a stream that moved to another rank included, must equal that
unbroken run's (:func:`~raydp.testing.fault_load.greedy_answers`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import raydp
from raydp.testing.fault_load import Answers, greedy_answers
from raydp.wire.sampling import Sampling

VLLM_ENGINE = "raydp.testing.hangs:HangableVllmEngine"  # vLLM's engine core, plus a hang on demand
# The small model's engine: several fit on a 2-core, 24 GiB machine, and start without compiling.
VLLM_FLAGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "16",
    "--kv-cache-memory-bytes",
    str(256 << 20),
)
VLLM_KINDS = ("rank-sigkill", "rank-ray-kill", "rank-hang", "coordinator-sigkill", "api-server-sigkill")
VLLM_STEP_TIMEOUT_S = 10.0  # a vLLM step of the small model takes milliseconds; a prefill under load, more
PROMPTS, ANSWER_TOKENS = 12, 64  # the vLLM soak's prompt pool, and the tokens of its unbroken answers


@dataclass(frozen=True)
class EngineSetup:
    """The mode's engine kwargs, and what launching it and its API servers takes beyond the defaults."""

    kwargs: dict[str, Any]
    launch: dict[str, Any] = field(default_factory=dict)
    servers: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(vllm: bool, model: str | None) -> EngineSetup:
        """The echo engine's (10 ms steps), or vLLM's on ``model`` (built if missing)."""
        if not vllm:
            return EngineSetup({"step_delay_s": 0.01})
        from raydp.cli import vllm_flags
        from raydp.models.checkpoint import default_model_dir, make_model

        path = str(make_model(model or default_model_dir()))
        return EngineSetup(
            vllm_flags.engine_kwargs(path, VLLM_FLAGS),
            launch={"accelerator": "CPU"},  # vLLM for CPUs: each rank a CPU bundle
            servers={"vllm_args": vllm_flags.frontend_flags(path, VLLM_FLAGS)},  # vLLM's own front-end
        )


def unbroken_answers(cluster: raydp.Cluster, rng: random.Random) -> Answers:
    """Each prompt of a seeded pool, answered greedily once before any fault: what every answer must equal."""
    client = cluster.client()
    pool = {tuple(rng.randrange(5, 300) for _ in range(rng.randrange(3, 9))) for _ in range(PROMPTS)}
    greedy = Sampling(temperature=0.0, ignore_eos=True)
    handles = {p: client.submit(list(p), ANSWER_TOKENS, sampling=greedy) for p in sorted(pool)}
    return greedy_answers({p: h.result(timeout=300) for p, h in handles.items()})


__all__ = ["VLLM_ENGINE", "VLLM_FLAGS", "VLLM_KINDS", "EngineSetup", "unbroken_answers"]
