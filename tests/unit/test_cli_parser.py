"""Every command-line flag is documented."""

from __future__ import annotations

import argparse

import pytest

from raydp.cli import build_parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_commands_exist() -> None:
    assert set(subcommands()) == {"demo", "serve", "plan"}


@pytest.mark.parametrize("command", ["demo", "serve", "plan"])
def test_every_flag_has_help(command: str) -> None:
    parser = subcommands()[command]
    undocumented = [
        a.option_strings for a in parser._actions if a.option_strings and not (a.help and a.help.strip())
    ]
    assert undocumented == []
    assert parser.description


def test_bad_flag_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["demo", "--dp-size", "two"])
    assert exit_info.value.code == 2
    assert "--dp-size" in capsys.readouterr().err
