"""raydp's CUDA paths on a real GPU, in one short run: ``python scripts/gpu_check.py [--out FILE]``.

CI has no GPU, so this is what shows that the paths only a GPU takes work:
the pinned input staging of the tensor-parallel LM, a worker's nccl group,
the reference engines on ``cuda:0``, and the planner's refusal of more ranks
than devices. It runs on the ``mp`` backend (no Ray needed) and checks
behaviour: the GPU's greedy tokens equal the CPU's (float64, so rounding
cannot flip an argmax). Its timings are ratios of runs side by side in this
one process, for the record, never a pass/fail.

Each check prints one line, ``ok`` or ``FAIL``, and the script exits non-zero
if any failed. ``--out`` writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import raydp
from raydp.errors import ConfigError
from raydp.models.tp_layers import InputStaging

TP_LM = "raydp.models.tp_lm:TPLMEngine"
TINY_LM = "raydp.models.tiny_lm:TinyLMEngine"
SMALL = {"vocab": 128, "dim": 32, "layers": 2, "heads": 4, "max_len": 48, "max_running": 8, "dtype": "float64"}
WIDE = {"vocab": 4096, "dim": 512, "layers": 4, "heads": 8, "max_len": 128, "max_running": 32}
PROMPTS = [[(11 * i + 5 * k) % 128 for k in range(1 + i % 9)] for i in range(12)]


def _launch(name: str, engine: str, accelerator: str, model: dict[str, Any]) -> raydp.Cluster:
    return raydp.launch(
        name=name, dp_size=1, backend="mp", engine=engine, engine_kwargs=model, accelerator=accelerator, progress=False
    )


def _generate(cluster: raydp.Cluster, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    client = cluster.client()
    handles = [client.submit(p, max_tokens=max_tokens) for p in prompts]
    return [h.result(timeout=300) for h in handles]


def check_staging() -> dict[str, Any]:
    """Pinned staging gives the same tensors as the host lists, across buffer growth and reuse."""
    staging = InputStaging(torch.device("cuda:0"))
    for n in (3, 700, 5000, 17, 5000):
        columns = [list(range(n)), list(range(n, 2 * n)), [n]]
        staged = staging.stage(*columns)
        assert all(t.device.type == "cuda" for t in staged), [t.device for t in staged]
        assert [t.tolist() for t in staged] == columns, f"staged values differ at n={n}"
    return {"pinned_elements": staging._pinned.numel() if staging._pinned is not None else 0}  # noqa: SLF001


def check_staging_speed() -> dict[str, Any]:
    """Pinned non-blocking copies against plain pageable ``.to(device)``: a ratio, for the record."""
    columns = [list(range(4096)), list(range(4096)), list(range(64))]
    staging = InputStaging(torch.device("cuda:0"))

    def pinned() -> None:
        staging.stage(*columns)[0].sum().item()

    def pageable() -> None:
        flat = torch.tensor([v for c in columns for v in c], dtype=torch.long)
        flat.to("cuda:0").split([len(c) for c in columns])[0].sum().item()

    return {"pinned_over_pageable": _time(pinned) / _time(pageable)}


def _time(fn: Callable[[], None], repeats: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def check_tp_lm() -> dict[str, Any]:
    """TPLMEngine's worker on cuda:0 in an nccl group gives the CPU worker's greedy tokens."""
    with _launch("gpulm", TP_LM, "GPU", SMALL) as cluster:
        gpu = _generate(cluster, PROMPTS, 6)
        workers = cluster.client().call_utility(0, "raydp_workers")
        stats = cluster.client().call_utility(0, "stats")["workers"]
    with _launch("cpulm", TP_LM, "CPU", SMALL) as cluster:
        cpu = _generate(cluster, PROMPTS, 6)
    assert gpu == cpu, f"GPU tokens {gpu} != CPU tokens {cpu}"
    assert len({tuple(t) for t in gpu}) > 3, "different prompts give different tokens"
    return {"workers": workers, "stats": stats}


def check_tiny_lm() -> dict[str, Any]:
    """TinyLMEngine (no workers) runs on the rank's visible device and streams tokens."""
    with _launch("gputiny", TINY_LM, "GPU", {"vocab": 128, "max_len": 48}) as cluster:
        tokens = _generate(cluster, PROMPTS[:4], 5)
        stats = cluster.client().call_utility(0, "stats")
    assert all(len(t) == 5 for t in tokens), tokens
    assert stats["device"].startswith("cuda"), stats
    return {"device": stats["device"], "tokens": tokens}


def check_too_many_ranks() -> dict[str, Any]:
    """More ranks than CUDA devices is a ConfigError naming the count, before any process starts."""
    have = torch.cuda.device_count()
    try:
        raydp.launch(name="toomany", dp_size=have + 1, backend="mp", engine=TINY_LM, progress=False).close()
    except ConfigError as exc:
        assert str(have) in str(exc), exc
        return {"error": str(exc)}
    raise AssertionError(f"dp_size={have + 1} on {have} devices was accepted")


def check_bfloat16() -> dict[str, Any]:
    """The worker runs a bfloat16 model on cuda:0 (what a real GPU serves) and streams every token."""
    with _launch("gpubf16", TP_LM, "GPU", {**SMALL, "dtype": "bfloat16"}) as cluster:
        tokens = _generate(cluster, PROMPTS, 6)
    assert all(len(t) == 6 for t in tokens), tokens
    return {"distinct": len({tuple(t) for t in tokens})}


def check_nothing_left() -> dict[str, Any]:
    """Once every cluster is closed, no process but this one holds the GPU."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    others = [line for line in out.splitlines() if line.strip() and line.split(",")[0].strip() != str(os.getpid())]
    assert not others, f"GPU processes left: {others}"
    return {"compute_apps": out.strip()}


def check_decode_speed() -> dict[str, Any]:
    """Decode tokens/s of a wider TP-LM on the GPU against the CPU, one after the other: a ratio."""
    prompts = [[(7 * i + k) % 4096 for k in range(32)] for i in range(32)]
    rates = {}
    for accelerator in ("GPU", "CPU"):
        with _launch(f"speed{accelerator.lower()}", TP_LM, accelerator, WIDE) as cluster:
            _generate(cluster, prompts[:2], 4)  # warm: CUDA context, kernels, caches
            started = time.perf_counter()
            tokens = _generate(cluster, prompts, 16)
            rates[accelerator] = sum(len(t) for t in tokens) / (time.perf_counter() - started)
    return {"tokens_per_s": rates, "gpu_over_cpu": rates["GPU"] / rates["CPU"]}


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "pinned staging": check_staging,
    "pinned staging speed": check_staging_speed,
    "tp-lm on cuda:0 (nccl group)": check_tp_lm,
    "tiny-lm on cuda:0": check_tiny_lm,
    "more ranks than devices": check_too_many_ranks,
    "bfloat16 tp-lm on cuda:0": check_bfloat16,
    "decode speed, GPU vs CPU": check_decode_speed,
    "no GPU process left": check_nothing_left,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "checks": {},
    }
    print(f"torch {report['torch']} cuda {report['cuda']} nccl {report['nccl']} on {report['device']}", flush=True)
    failed = 0
    for name, check in CHECKS.items():
        started = time.perf_counter()
        try:
            result = {"ok": True, **check()}
        except Exception as exc:  # one failed check must not hide the others
            failed += 1
            result = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - started, 2)
        report["checks"][name] = result
        shown = {k: v for k, v in result.items() if k not in ("traceback", "workers", "stats", "info")}
        print(f"{'ok  ' if result['ok'] else 'FAIL'} {name}: {json.dumps(shown, default=str)}", flush=True)
        if not result["ok"]:
            print(result["traceback"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
