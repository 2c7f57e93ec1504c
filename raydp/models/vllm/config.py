"""Building one rank's vLLM engine configuration from ``engine_kwargs``.

Every key of ``engine_kwargs`` is a vLLM engine argument (``vllm.EngineArgs``'s
fields: ``model``, ``dtype``, ``max_model_len``, ``max_num_seqs``,
``enable_prefix_caching``, ``enforce_eager``, ...), passed through as given.
An unknown key, or a value vLLM refuses, raises :class:`~raydp.errors.ConfigError`
with vLLM's own message and the field's name, so a bad field fails the launch.

raydp owns data parallelism, so the fields that would make vLLM start its
own DP ranks or API processes are refused. Each rank runs one engine core in
its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): on CPU, vLLM would
otherwise move a single-process engine to its multiprocessing executor, which
spawns a worker per engine, starts 2-3x slower and pins every such worker to
core 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

from raydp.errors import ConfigError

# vLLM's own data parallelism would fight raydp's: raydp places, starts and balances the ranks.
OWNED_BY_RAYDP: Final = {
    "data_parallel_size": "dp_size",
    "data_parallel_rank": "the rank raydp gives each engine",
    "data_parallel_size_local": "dp_size_local",
    "data_parallel_address": "raydp's own placement",
    "data_parallel_rpc_port": "raydp's own sockets",
    "data_parallel_backend": "raydp's own placement",
    "api_server_count": "raydp serve --api-servers",
}
# On CPU, vLLM sizes its reservation as gpu_memory_utilization (0.9) of the machine's memory
# unless told a KV-cache size, and refuses to start when that much is not free: the second
# engine on a machine never starts. A rank gets this much KV cache unless engine_kwargs or
# VLLM_CPU_KVCACHE_SPACE (GiB, vLLM's own variable) say otherwise.
CPU_KV_CACHE_BYTES: Final = 1 << 30
# raydp's own parallel config decides these; a different value in engine_kwargs would disagree with the placement.
SET_BY_RAYDP: Final = ("tensor_parallel_size", "pipeline_parallel_size")
# What a fork server imports before it forks vLLM's processes (raydp.fork_server.child_context).
FORK_SERVER_PRELOAD: Final = ("raydp.models.vllm.preload",)


def set_process_environment() -> None:
    """Environment vLLM reads at import: call it before the first ``import vllm``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Ray starts actors with OMP_NUM_THREADS=1 unless told otherwise; vLLM's CPU
    # backend binds its own OpenMP threads and warns about the variable.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a rank loads local checkpoints; it never waits on a hub


def check_kwargs(engine_kwargs: Mapping[str, Any], tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """The checks that need no vLLM import: fields raydp owns, and what raydp's config already says."""
    if "model" not in engine_kwargs:
        raise ConfigError("engine_kwargs.model: required (a local Hugging Face checkpoint directory or model id)")
    for key, owner in OWNED_BY_RAYDP.items():
        if key in engine_kwargs:
            raise ConfigError(f"engine_kwargs.{key}={engine_kwargs[key]!r}: raydp sets this ({owner}); leave it out")
    given = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
    for key in SET_BY_RAYDP:
        if key in engine_kwargs and engine_kwargs[key] != given[key]:
            raise ConfigError(
                f"engine_kwargs.{key}={engine_kwargs[key]!r}: must match raydp's {key}={given[key]} "
                "(set it on the cluster config, not in engine_kwargs)"
            )


def engine_args(engine_kwargs: Mapping[str, Any], tensor_parallel_size: int, pipeline_parallel_size: int) -> Any:
    """``vllm.EngineArgs`` for one rank; ConfigError naming the field on a bad one."""
    check_kwargs(engine_kwargs, tensor_parallel_size, pipeline_parallel_size)
    from vllm.engine.arg_utils import EngineArgs

    known = set(EngineArgs.__dataclass_fields__)
    for key in engine_kwargs:
        if key not in known:
            raise ConfigError(f"engine_kwargs.{key}: not a vLLM engine argument (vllm.EngineArgs has no such field)")
    fields = {
        **_platform_defaults(engine_kwargs),
        **engine_kwargs,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
    }
    try:
        return EngineArgs(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"engine_kwargs: vLLM refused them: {exc}") from None


def _platform_defaults(engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    from vllm.platforms import current_platform

    if (
        current_platform.is_cpu()
        and "kv_cache_memory_bytes" not in engine_kwargs
        and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    ):
        return {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    return {}


def create_config(args: Any) -> Any:
    """The ``VllmConfig`` of ``args``; vLLM's own message (which names the field) on a refusal."""
    from vllm.usage.usage_lib import UsageContext

    try:
        return args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    except (TypeError, ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"engine_kwargs: vLLM refused them: {_first_lines(str(exc))}") from None


def _first_lines(text: str, lines: int = 12) -> str:
    kept = text.strip().splitlines()[:lines]
    return "\n".join(kept)
