"""``python -m benchmarks --plot``: the markdown tables the benchmark prints are what gets drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.plot import columns, number, parse_tables, plot_sections

pytestmark = pytest.mark.timeout(60)
TABLE = """### Round trips

| system | req/s | raydp / it | p50 ms |
|---|---:|---:|---:|
| raydp | 23,032 | **1.00x** | 0.47 |
| raw floor | 30,539 | 0.75x | 0.33 |
| Ray Serve | failed: no fastapi | | |

Target: met
""".splitlines()


def test_tables_are_parsed_with_their_heading_and_numbers_with_their_units() -> None:
    [(title, header, rows)] = parse_tables(TABLE)
    assert title == "Round trips"
    assert header == ["system", "req/s", "raydp / it", "p50 ms"]
    assert [r[0] for r in rows] == ["raydp", "raw floor", "Ray Serve"]
    assert [number(c) for c in ("23,032", "**1.00x**", "0.47", "1.87 s", "18.7%", "-", "failed")] == [
        23032.0,
        1.0,
        0.47,
        1.87,
        18.7,
        None,
        None,
    ]


def test_every_table_becomes_a_png(tmp_path: Path) -> None:
    written = plot_sections({"round-trips": TABLE, "empty": ["no table here"]}, tmp_path)
    assert written == [tmp_path / "round-trips-1.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_first_column_names_the_rows_even_when_it_is_a_number() -> None:
    [(_, header, rows)] = parse_tables(
        """### Lockstep

| step_delay_s | **lockstep / dense** | >= 0.8 | dense / bare loop |
|---:|---:|---|---:|
| 0.002 | **0.98x** | yes | 0.91x |
| 0 | **0.87x** | yes | n/a |
""".splitlines()
    )
    bars, names = columns(header, rows)
    assert [header[c] for c in bars] == ["**lockstep / dense**", "dense / bare loop"]
    assert [header[c] for c in names] == ["step_delay_s", ">= 0.8"]
