"""The README's usage example runs as written (on a cluster with GPUs)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.timeout(180)
def test_the_usage_example_runs(two_nodes: Any, capsys: pytest.CaptureFixture[str]) -> None:
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block, "the README has a python example"
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)
    printed = capsys.readouterr().out.split()
    assert len(printed) == 8, "the stream printed one line per token chunk"
    assert len(namespace["tokens"]) == 8
    cluster = namespace["cluster"]
    with pytest.raises(Exception, match="closed"):
        cluster.client()
