"""The small offline checkpoint and vLLM's own answers on it, shared by the vLLM tests.

The checkpoint is built once per machine (``make_model`` is idempotent) under
the temp directory. vLLM's reference answers come from its offline ``LLM`` in
a subprocess: vLLM changes the process it runs in (torch's thread count, NUMA
memory binding, the global RNG), which the test process must not inherit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from raydp.models.checkpoint import make_model

# Small enough that several engines fit on a 2-core, 24 GiB machine; fast to start (no compile).
ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 16,
    "kv_cache_memory_bytes": 256 << 20,
}


def tiny_model() -> Path:
    return make_model(Path(tempfile.gettempdir()) / "raydp-tests" / "tiny-llama")


_REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
spec = json.loads(sys.argv[1])
llm = LLM(model=spec["model"], **spec["kwargs"])
answers = []
for prompt, params in spec["requests"]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params), use_tqdm=False)
    answers.append(list(out[0].outputs[0].token_ids))
print("ANSWERS " + json.dumps(answers))
"""


Requests = list[tuple[list[int], dict[str, Any]]]
_wanted: dict[str, tuple[list[int], dict[str, Any]]] = {}  # every module's requests, keyed by _key
_answers: dict[str, list[int]] = {}


def _key(prompt: list[int], params: dict[str, Any]) -> str:
    return json.dumps([prompt, params], sort_keys=True)


def want_reference(requests: Requests) -> Requests:
    """Declare (at import) requests a module will ask :func:`vllm_reference` about: the first call
    answers every declared one in a single vLLM start (~10 s each here), for all modules."""
    _wanted.update({_key(p, q): (p, q) for p, q in requests})
    return requests


def vllm_reference(model: Path, requests: Requests) -> list[list[int]]:
    """What vLLM's offline ``LLM.generate`` answers to each ``(prompt ids, SamplingParams fields)``."""
    want_reference(requests)
    missing = [k for k in _wanted if k not in _answers]
    if missing:
        answered = _run_reference(model, [_wanted[k] for k in missing])
        _answers.update(zip(missing, answered, strict=True))
    return [_answers[_key(p, q)] for p, q in requests]


def _run_reference(model: Path, requests: Requests) -> list[list[int]]:
    spec = json.dumps({"model": str(model), "kwargs": ENGINE_KWARGS, "requests": requests})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE, spec], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("ANSWERS ")]
    assert done.returncode == 0 and lines, f"vLLM's reference run failed:\n{done.stderr[-3000:]}"
    answers: list[list[int]] = json.loads(lines[-1].removeprefix("ANSWERS "))
    return answers
