"""Every subpackage's docstring names exactly the modules it has.

The convention: a subpackage's ``__init__`` docstring ends with a ``Modules:``
line followed by one bullet per module, ``- ``name``: what it owns`` (``*``
bullets too; continuation lines indented). A module is a ``name.py`` beside the
``__init__.py`` (``__init__`` and ``__main__`` aside) or a folder with an
``__init__.py`` of its own. The prose above the list may say anything; the list
is what this test holds to the files, so a module that moves, appears or goes
fails here until its package's docstring says so.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

RAYDP = Path(__file__).resolve().parents[2] / "raydp"
BULLET = re.compile(r"^[-*] ``([A-Za-z_][A-Za-z0-9_]*)``:")


def subpackages(root: Path) -> list[Path]:
    """Every folder under ``root`` holding Python, through the ``actors`` and ``placement`` symlinks."""
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if any(folder.glob("*.py")):
            found.append(folder)
            found.extend(subpackages(folder))
    return found


def modules_of(package: Path) -> set[str]:
    files = {p.stem for p in package.glob("*.py") if p.stem not in {"__init__", "__main__"}}
    folders = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return files | folders


def listed_modules(docstring: str) -> list[str]:
    """The names in the ``Modules:`` list, in order, duplicates kept."""
    lines = docstring.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "Modules:"]
    assert len(starts) == 1, "the docstring has exactly one line reading 'Modules:'"
    names = []
    for line in lines[starts[0] + 1 :]:
        if not line.strip() or line.startswith(" "):
            continue  # a blank line or a bullet's continuation
        match = BULLET.match(line)
        assert match, f"not a module bullet ('- ``name``: ...'): {line!r}"
        names.append(match.group(1))
    return names


PACKAGES = subpackages(RAYDP)


def test_the_walk_finds_the_symlinked_packages() -> None:
    names = {p.relative_to(RAYDP).as_posix() for p in PACKAGES}
    assert {"actors", "placement", "wire", "engine", "client"} <= names


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.relative_to(RAYDP).as_posix())
def test_the_docstring_names_exactly_the_modules(package: Path) -> None:
    init = package / "__init__.py"
    assert init.exists(), f"{package.name}/ holds Python but no __init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text()))
    assert docstring, f"{init} has no docstring"
    listed = listed_modules(docstring)
    assert len(listed) == len(set(listed)), f"named twice: {sorted({n for n in listed if listed.count(n) > 1})}"
    actual = modules_of(package)
    assert set(listed) == actual, (
        f"listed but missing: {sorted(set(listed) - actual)}; present but not listed: {sorted(actual - set(listed))}"
    )
