"""The command line with vLLM engines: ``raydp demo --engine vllm`` on first use, and what a wrong flag says."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import ClusterPool
from tests.integration.test_cli import raydp_cli


@pytest.mark.timeout(400)
def test_demo_with_vllm_builds_the_small_model_on_first_use_and_runs_it(
    cluster_pool: ClusterPool, tmp_path: Path
) -> None:
    cluster_pool.shutdown()  # the demo starts its own local Ray, as on a laptop
    cache = tmp_path / "models" / "tiny"
    proc = raydp_cli(
        "demo",
        "--engine",
        "vllm",
        "--requests",
        "24",
        "--no-progress",
        "--max-num-seqs",
        "8",
        "--address",
        "local",
        extra_env={"RAYDP_MODEL_CACHE": str(cache)},
    )
    out, err = proc.communicate(timeout=360)
    assert proc.returncode == 0, err[-3000:]
    assert f"vLLM engines on the small offline model at {cache}" in out
    assert "launched 2 ranks of raydp.models.vllm:VllmEngine" in out and "total: 24 requests" in out
    assert (cache / "config.json").is_file() and (cache / "tokenizer.json").is_file()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--engine", "vllm"], "--model: required with --engine vllm"),
        (["--engine", "vllm", "--model", "/nonexistent", "--max-model-len", "many"], "--max-model-len"),
        (["--engine", "echo", "--max-model-len", "64"], "unrecognized arguments: --max-model-len 64"),
        (["--engine", "echo", "--model", "/m"], "--model='/m': applies to --engine vllm only"),
    ],
)
def test_a_wrong_engine_flag_fails_before_anything_starts_naming_it(flags: list[str], said: str) -> None:
    proc = raydp_cli("serve", "--backend", "mp", "--port", "0", *flags)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 2 and said in err, err[-2000:]
