"""`metrale serve --stall-timeout / --exit-on-stall`: the watchdog's flags reach the server
settings (and from there the scheduler); bad values exit 2 naming the flag."""

from __future__ import annotations

import pytest

from serving.cli import build_parser, main


def _settings(*flags: str):
    from serving.cli.serve import check_flags, server_settings
    args = build_parser().parse_args(["serve", *flags])
    check_flags(args)
    return server_settings(args)


def test_the_flags_reach_the_settings():
    settings = _settings("--stall-timeout", "30", "--exit-on-stall")
    assert settings.stall_timeout == 30.0 and settings.exit_on_stall is True
    default = _settings()
    assert default.stall_timeout is None and default.exit_on_stall is False


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan", "inf"])
def test_a_bad_timeout_exits_2(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--stall-timeout", value])
    assert e.value.code == 2
    assert "--stall-timeout" in capsys.readouterr().err
