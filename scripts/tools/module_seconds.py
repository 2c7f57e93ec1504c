"""Sum a pytest run's ``--durations=0`` report per test module, for ``tests/integration/module_seconds.json``.

    pytest tests/integration -m "not soak" -n 2 --dist loadfile --durations=0 > run.log
    python scripts/tools/module_seconds.py < run.log > tests/integration/module_seconds.json

The integration conftest hands xdist the longest modules first with this table
(longest-processing-time first keeps the two workers' last modules short); a
module missing from it counts as a median one, so a stale table only costs time.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict

# "12.34s setup    tests/integration/test_x.py::test_y[param]"
LINE = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+\S*?([^/\s]+\.py)::")


def module_seconds(lines: list[str]) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for line in lines:
        match = LINE.match(line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    return {module: round(total, 1) for module, total in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    json.dump(module_seconds(sys.stdin.readlines()), sys.stdout, indent=1)
    sys.stdout.write("\n")
