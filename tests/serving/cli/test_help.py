"""Every `metrale` subcommand documents every flag, and `--help` exits 0."""

from __future__ import annotations

import argparse

import pytest

from serving.cli import build_parser, main

COMMANDS = ("pull", "convert", "generate", "embed", "serve", "models", "chat", "bench", "top",
            "replay")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_is_registered():
    assert set(_subparsers()) == set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_flag_has_help(name, capsys):
    parser = _subparsers()[name]
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{name} {action.option_strings}"
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: metrale {name}")
