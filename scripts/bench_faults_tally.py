"""What the failure table's extra rows share: the repository's root, a row's running tally, the log line."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Tally:
    """Per row: the trials' times and the in-flight requests' outcomes."""

    detect_s: list[float] = field(default_factory=list)
    back_s: list[float] = field(default_factory=list)
    requests: int = 0
    lost: int = 0
    typed: int = 0
    bad: int = 0
    errors: list[str] = field(default_factory=list)

    def row(self, label: str, happens: str) -> Any:
        from bench_faults import FaultRow

        return FaultRow(label, happens, self.detect_s, self.back_s, self.requests, self.lost, self.typed, self.bad,
                        "; ".join(self.errors)[:400])


def log(text: str) -> None:
    print(f"[faults-extra] {text}", file=sys.stderr, flush=True)

