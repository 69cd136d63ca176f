"""`metrale serve --max-itl-ms`: the latency target reaches the server settings; bad values
exit 2 naming the flag."""

from __future__ import annotations

import pytest

from serving.cli import build_parser, main


def _settings(*flags: str):
    from serving.cli.serve import check_flags, server_settings
    args = build_parser().parse_args(["serve", *flags])
    check_flags(args)
    return server_settings(args)


def test_the_flag_reaches_the_settings():
    assert _settings("--max-itl-ms", "150").max_itl_ms == 150.0
    assert _settings("--max-itl-ms", "0").max_itl_ms == 0.0  # no target
    assert _settings().max_itl_ms is None  # the scheduler's default


@pytest.mark.parametrize("value", ["-1", "fast", "nan", "inf"])
def test_a_bad_target_exits_2(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-itl-ms", value])
    assert e.value.code == 2
    assert "--max-itl-ms" in capsys.readouterr().err


def test_the_default_matches_the_scheduler():
    from metrale_jax.scheduler.step_time import DEFAULT_MAX_ITL_MS
    flag = next(a for a in _serve_parser()._actions if "--max-itl-ms" in a.option_strings)
    assert f"default {DEFAULT_MAX_ITL_MS:g}" in flag.help


def _serve_parser():
    import argparse
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]
