"""``raydp demo``: DP=2 on an embedded local Ray, a few hundred requests, a summary."""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import Counter
from contextlib import AbstractContextManager
from typing import Any

from raydp.cli.options import (
    ENGINES,
    SERVING_PRESETS,
    add_config_flags,
    add_model_flag,
    config_from_args,
    pools_note,
    with_engine_flags,
)
from raydp.cli.signals import install_stop_handlers

# vLLM settings for the demo's small model on a laptop: no graph capture or compile at startup.
VLLM_DEMO_KWARGS = {"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 32}
# The demo's own starting point; RAYDP_* variables and flags override it.
PRESETS = SERVING_PRESETS
CONFIG_FLAGS = (
    "dp_size",
    "prefill_dp_size",
    "decode_dp_size",
    "tensor_parallel_size",
    "prefill_tensor_parallel_size",
    "engine",
    "lockstep",
    "accelerator",
    "placement_strategy",
    "max_restarts",
    "transport",
    "auth",
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run DP ranks on a local (or given) Ray cluster and push requests through them",
        description="Launch a data-parallel cluster of the reference engine, send requests "
        "through the load-balancing client, print a per-rank summary and shut down cleanly. "
        f"Engines by short name: {', '.join(sorted(ENGINES))}; or a 'module:Class' path.",
    )
    add_config_flags(p, CONFIG_FLAGS, PRESETS)
    add_model_flag(p)
    p.add_argument("--requests", type=int, default=300, help="requests to send (default 300)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    p.add_argument("--prompt-len", type=int, default=8, help="prompt length in tokens (default 8)")
    p.add_argument(
        "--local-gpus",
        type=int,
        default=4,
        help="logical GPUs declared when a local Ray is started (default 4; none need exist)",
    )
    p.add_argument(
        "--address", default=None, help="Ray address to join (default: the ambient cluster, else start a local one)"
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from raydp.api import launch

    config = config_from_args(args, CONFIG_FLAGS, {**PRESETS, "name": f"demo-{os.getpid()}"})
    if config.engine == ENGINES["vllm"] and not args.model:
        from raydp.models.checkpoint import default_model_dir, make_model

        args.model = str(make_model(default_model_dir()))  # built once, then reused
        print(f"vLLM engines on the small offline model at {args.model}")
    config = with_engine_flags(config, args, VLLM_DEMO_KWARGS)
    with _ray(args, config):
        install_stop_handlers()  # again: ray.init sets a SIGTERM handler of its own
        with launch(config, progress=not args.no_progress) as cluster:
            pools = pools_note(config)
            print(f"launched {cluster.dp_size} ranks of {config.engine}{pools}, capacity {cluster.capacity}")
            if config.world_size > 1:
                print(f"each rank shards over {config.world_size} device workers")
            summary = _drive(cluster, args)
            _print_summary(cluster, summary)
    return 0


def _ray(args: argparse.Namespace, config: Any) -> AbstractContextManager[None]:
    """Join a cluster if there is one; else start a local Ray with logical GPUs (and CPUs for the plan)."""
    from raydp.actors.connection import connected, local_resources

    cpus = max(
        os.cpu_count() or 1,
        config.dp_size + 1,
        local_resources(config).get("num_cpus", 0),
    )
    return connected(args.address, local={"num_cpus": cpus, "num_gpus": args.local_gpus}, quiet=True)


def _drive(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    rng = random.Random(0)
    client = cluster.client()
    start = time.perf_counter()
    handles = [
        client.submit([rng.randrange(256) for _ in range(args.prompt_len)], args.max_tokens)
        for _ in range(args.requests)
    ]
    per_rank: Counter[int] = Counter()
    tokens = 0
    for handle in tqdm(handles, desc="requests", unit="req", disable=args.no_progress):
        tokens += len(handle.result(timeout=120))
        per_rank.update(set(handle.ranks))  # P/D: its prefill rank and its decode rank
    elapsed = time.perf_counter() - start
    return {"per_rank": per_rank, "tokens": tokens, "elapsed": elapsed, "requests": len(handles)}


def _print_summary(cluster: Any, s: dict[str, Any]) -> None:
    """A row per rank; a request counts on every rank it ran on (over P/D pools, one in each pool)."""
    elapsed, endpoints = s["elapsed"], cluster.endpoints
    print(f"\n{'rank':>4}  {'pool':<8} {'node':<10} {'requests':>8}  {'share':>6}  {'req/s':>8}")
    for ep in endpoints.engines:
        n, pool = s["per_rank"][ep.rank], endpoints.pool(ep.rank) or "-"
        print(f"{ep.rank:>4}  {pool:<8} {ep.node_id[:8]:<10} {n:>8}  {n / s['requests']:>6.0%}  {n / elapsed:>8.1f}")
    print(
        f"total: {s['requests']} requests, {s['tokens']} tokens in {elapsed:.2f}s "
        f"({s['requests'] / elapsed:.1f} req/s, {s['tokens'] / elapsed:.0f} tok/s)"
    )
