"""What both failure tables share: a row, its table, a row's running tally, and running rows in a process of their own.

:mod:`benchmarks.faults.dense` measures the ``faults`` rows and
:mod:`benchmarks.faults.extra` the ``faults-extra`` ones; each runs in a
process of its own (``python -m benchmarks.faults.dense``), started from the
repository's root so that ``benchmarks`` imports there too.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class FaultRow:
    fault: str
    happens: str
    detect_s: list[float]  # per trial; nan where not detected in time
    back_s: list[float]
    requests: int = 0
    lost: int = 0
    typed: int = 0
    bad: int = 0  # wrong, duplicate or untyped
    error: str = ""

    def median(self, xs: list[float]) -> float:
        return statistics.median(xs) if xs and not any(math.isnan(x) for x in xs) else float("nan")


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

    def row(self, label: str, happens: str) -> FaultRow:
        return FaultRow(
            label,
            happens,
            self.detect_s,
            self.back_s,
            self.requests,
            self.lost,
            self.typed,
            self.bad,
            "; ".join(self.errors)[:400],
        )


def log(text: str) -> None:
    print(f"[faults-extra] {text}", file=sys.stderr, flush=True)


def faults_failed(rows: list[FaultRow]) -> bool:
    return any(r.error or r.lost or r.bad for r in rows)


def faults_table(rows: list[FaultRow]) -> list[str]:
    lines = [
        "### Failures: detection, recovery, requests lost",
        "",
        "Medians of the trials (min-max in brackets), under a light load (driver ~10 req/s, HTTP ~4 req/s "
        "where API servers run).",
        "",
        "| fault | what happens | detected | serving again | requests | lost | typed failures |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lost = f"{r.lost}" + (f" (+{r.bad} bad)" if r.bad else "")
        lines.append(
            f"| {r.fault} | {r.happens} | {_ms(r, r.detect_s)} | {_ms(r, r.back_s)} | {r.requests} | "
            f"{lost} | {r.typed} |"
        )
    lines.append("")
    lines += [f"- {r.fault}: FAILED: {r.error}" for r in rows if r.error]
    lines.append(
        "Targets: a process death detected within 0.1 s; a dense rank and the coordinator back within 2 s; "
        "a lockstep gang back within 5 s; 0 requests lost."
    )
    return lines


def _ms(row: FaultRow, xs: list[float]) -> str:
    med = row.median(xs)
    if math.isnan(med):
        return "n/a"
    return f"{med * 1000:.0f} ms ({min(xs) * 1000:.0f}-{max(xs) * 1000:.0f})"


def rows_from_process(module: str, trials: int, run: Callable[..., Any], timeout: float) -> list[FaultRow]:
    """``python -m module --trials N --json PATH --quiet`` as a process of its own; its rows, or one naming its exit."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = run(
            [sys.executable, "-m", module, "--trials", str(trials), "--json", out.name, "--quiet"],
            check=False,
            timeout=timeout,
            cwd=REPO,
        )
        text = Path(out.name).read_text()
    if proc.returncode not in (0, 1) or not text:
        return [FaultRow("all", "", [], [], error=f"{module} exited {proc.returncode}")]
    return [FaultRow(**row) for row in json.loads(text)]
