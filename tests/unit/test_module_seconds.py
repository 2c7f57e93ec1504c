"""scripts/tools/module_seconds.py: a run's --durations=0 report summed per module, the longest first."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "module_seconds.py"
spec = importlib.util.spec_from_file_location("module_seconds", SCRIPT)
assert spec is not None and spec.loader is not None
module_seconds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module_seconds)

REPORT = """\
============================== slowest durations ===============================
147.71s setup    tests/integration/test_vllm_parity.py::test_raydp_answers_as_vllm_does[greedy]
30.67s call     tests/integration/test_vllm_parity.py::test_a_stream_whose_rank_dies[a::b]
88.05s call     tests/integration/test_hangs.py::test_a_vllm_rank_hangs
0.01s teardown tests/integration/test_hangs.py::test_a_slow_engine_is_never_declared_hung
[gw0] [ 98%] PASSED tests/integration/test_hangs.py::test_a_vllm_rank_hangs
(551 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_each_module_gets_the_sum_of_its_phases_longest_first() -> None:
    seconds = module_seconds.module_seconds(REPORT.splitlines())
    assert seconds == {"test_vllm_parity.py": 178.4, "test_hangs.py": 88.1}
    assert list(seconds) == ["test_vllm_parity.py", "test_hangs.py"]


def test_the_committed_table_names_only_modules_that_exist() -> None:
    """A renamed module would silently count as a median one: the table must follow renames."""
    folder = SCRIPT.parents[2] / "tests" / "integration"
    table = json.loads((folder / "module_seconds.json").read_text())
    assert sorted(name for name in table if not (folder / name).is_file()) == []
    assert all(seconds > 0 for seconds in table.values())
