"""``python -m benchmarks``: its section choice (names, aliases, comma lists, opt-in, --skip) and its docstrings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmarks.__main__ import parse
from benchmarks.sections import SECTIONS
from tests.unit.test_package_docstrings import listed_modules, modules_of, subpackages

pytestmark = pytest.mark.timeout(60)


def names(argv: list[str]) -> list[str]:
    return [s.name for s in parse(argv).sections]


def test_the_default_run_is_every_section_but_the_opt_in_ones() -> None:
    assert names([]) == [s.name for s in SECTIONS if not s.opt_in]
    assert {"faults-extra", "gang", "vllm"}.isdisjoint(names([]))


def test_only_takes_aliases_comma_lists_and_repeats_and_keeps_the_run_order() -> None:
    assert names(["--only", "roundtrip"]) == ["round-trips"]
    assert names(["--only", "routing,round-trips", "--only", "vllm"]) == ["round-trips", "routing", "vllm"]


def test_skip_leaves_sections_out_and_an_empty_choice_is_refused() -> None:
    assert "lockstep" not in names(["--skip", "lockstep"])
    with pytest.raises(SystemExit):
        parse(["--only", "coordinator", "--skip", "coordinator"])
    with pytest.raises(SystemExit):
        parse(["--only", "no-such-section"])


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


# A folder without an __init__ is no package: files put on another process's path (vllm_dp/hang_hook).
PACKAGES = [p for p in [BENCHMARKS, *subpackages(BENCHMARKS)] if (p / "__init__.py").exists()]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_each_benchmark_package_docstring_names_exactly_its_modules(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert docstring, f"{package} has no docstring"
    assert set(listed_modules(docstring)) == modules_of(package)
