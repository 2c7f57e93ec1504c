"""The README stays short, and its links to the docs pages lead somewhere.

The pages under ``docs/`` are checked by ``mkdocs build --strict`` in the test
command; the README is not part of that site, so its own relative links, and
their anchors, are checked here, the anchors as GitHub renders headings.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_BYTES = 16_000  # issue 25: the benchmark tables and the rest live under docs/
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    lines = page.read_text().splitlines()
    fenced = False
    found = set()
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(github_anchor(line.lstrip("#")))
    return found


def test_the_readme_stays_under_its_budget() -> None:
    assert len(README.read_bytes()) <= MAX_BYTES


def test_every_relative_link_in_the_readme_resolves() -> None:
    links = [link for link in LINK.findall(README.read_text()) if "://" not in link]
    assert links, "the README links to its docs pages"
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.exists(), f"README links to {link}: no such file"
        if anchor:
            assert anchor in anchors_of(target), f"README links to {link}: no such heading in {path or 'README.md'}"
