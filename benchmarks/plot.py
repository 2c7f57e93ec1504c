"""``python -m benchmarks --plot DIR``: every markdown table the benchmark prints, drawn as PNG bar charts.

Charts are made from the printed tables themselves, so whatever a section
reports is what is drawn: one PNG per table, one horizontal bar panel per
numeric column (rows labelled by their text columns). Columns of ratios
(``1.23x``) get a line at 1.
"""

from __future__ import annotations

import re
from pathlib import Path

_NUMBER = re.compile(r"^\*{0,2}(-?[\d,]*\.?\d+)\s*(x|s|ms|µs|%|B)?\*{0,2}$")


def parse_tables(lines: list[str]) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` of each markdown table in ``lines``; the title is the nearest heading."""
    tables: list[tuple[str, list[str], list[list[str]]]] = []
    title, i = "", 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            title = line.lstrip("# ").strip()
        is_table = line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: ")
        if not is_table:
            i += 1
            continue
        header = _cells(line)
        rows, i = [], i + 2
        while i < len(lines) and lines[i].strip().startswith("|"):
            rows.append(_cells(lines[i]))
            i += 1
        tables.append((title, header, rows))
    return tables


def _cells(line: str) -> list[str]:
    return [c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]


def number(cell: str) -> float | None:
    """``'23,032'`` -> 23032.0, ``'1.23x'`` -> 1.23, ``'0.47 s'`` -> 0.47; None for text."""
    found = _NUMBER.match(cell.replace(" ", "")) if cell else None
    return float(found.group(1).replace(",", "")) if found else None


_NOT_APPLICABLE = ("-", "n/a")


def _numeric_column(cells: list[str]) -> bool:
    return any(c not in _NOT_APPLICABLE for c in cells) and all(
        c in _NOT_APPLICABLE or number(c) is not None for c in cells
    )


def columns(header: list[str], rows: list[list[str]]) -> tuple[list[int], list[int]]:
    """The columns drawn as bars and those naming a row: the first always names it (a step delay too)."""
    numeric = [c for c in range(1, len(header)) if _numeric_column([r[c] for r in rows])]
    return numeric, [c for c in range(len(header)) if c not in numeric]


def plot_sections(sections: dict[str, list[str]], out_dir: Path) -> list[Path]:
    """Draw every table of every section into ``out_dir``; return the files written."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for section, lines in sections.items():
        for n, (title, header, rows) in enumerate(parse_tables(lines), start=1):
            path = out_dir / f"{section}-{n}.png"
            if _plot_table(title or section, header, rows, path):
                written.append(path)
    return written


def _plot_table(title: str, header: list[str], rows: list[list[str]], path: Path) -> bool:
    import matplotlib.pyplot as plt

    # A failed measurement has no numbers to draw; a '-' is a figure that does not apply (no bar).
    rows = [r for r in rows if len(r) == len(header) and not any(c.startswith("failed") for c in r)]
    numeric, text = columns(header, rows)
    if not numeric:
        return False
    labels = [" / ".join(r[c] for c in text if r[c] not in ("", *_NOT_APPLICABLE))[:70] for r in rows]
    cols = min(3, len(numeric))
    grid = -(-len(numeric) // cols)
    fig, axes = plt.subplots(
        grid, cols, figsize=(4.2 * cols + 3, (0.4 * len(rows) + 1.2) * grid + 0.4), sharey=True, squeeze=False
    )
    panels = [ax for row in axes for ax in row]
    for ax in panels[len(numeric) :]:
        ax.set_visible(False)
    for ax, c in zip(panels, numeric, strict=False):
        values = [number(r[c]) if r[c] not in _NOT_APPLICABLE else float("nan") for r in rows]
        ax.barh(range(len(rows)), values, color="#4878a8")
        ax.set_title(header[c], fontsize=9)
        ax.tick_params(labelsize=8)
        if all(r[c].rstrip("*").endswith("x") for r in rows if r[c] not in _NOT_APPLICABLE):
            ax.axvline(1.0, color="#c44", linewidth=1)
    for row in axes:
        row[0].set_yticks(range(len(rows)), labels)
    axes[0][0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
