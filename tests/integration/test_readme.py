"""The README's usage example runs as written (on a cluster with GPUs)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

import raydp
from tests.integration.helpers import assert_nothing_left

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.timeout(180)
def test_the_usage_example_runs(two_nodes: Any, capsys: pytest.CaptureFixture[str]) -> None:
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block, "the README has a python example"
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)
    chunks = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert chunks and all(isinstance(c, list) for c in chunks), "the stream printed token chunks"
    assert sum(len(c) for c in chunks) == 8, "max_tokens=8 arrived in full"
    assert len(namespace["tokens"]) == 8
    assert namespace["handle"].rank == 1, "rank=1 pins the request"
    cluster = namespace["cluster"]
    with pytest.raises(raydp.ClusterClosedError):
        cluster.client()
    # "actors, groups, sockets: gone", as the example's comment promises.
    assert_nothing_left(cluster.name)
