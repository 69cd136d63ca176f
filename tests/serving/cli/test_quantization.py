"""`--quantization` on `metrale serve`, `generate` and `convert` (`models/quant.py`) and
`--kv-cache-dtype` on `serve` and `generate` (`models/kv_quant.py`): a bad value exits 2 naming
the choices; `convert --quantization int8` (or int4) stores the quantized arrays, which
load quantized without the flag."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from serving.cli import build_parser, main


@pytest.mark.parametrize("command", ["serve", "generate", "convert"])
def test_a_bad_value_exits_2_naming_the_choices(command, capsys):
    extra = ["src", "dst"] if command == "convert" else []
    with pytest.raises(SystemExit) as e:
        main([command, *extra, "--quantization", "int3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--quantization: invalid choice: 'int3'" in err and "'int8'" in err
    assert "'int4'" in err


def test_serve_passes_it_to_the_engine():
    from serving.cli.serve import check_flags, server_settings

    def settings(*flags: str):
        args = build_parser().parse_args(["serve", *flags])
        check_flags(args)
        return server_settings(args)
    assert settings("--quantization", "int8").engine_options["quantization"] == "int8"
    assert settings("--quantization", "int4").engine_options["quantization"] == "int4"
    assert "quantization" not in settings().engine_options


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_bad_kv_cache_dtype_exits_2_naming_the_choices(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--kv-cache-dtype", "fp8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype: invalid choice: 'fp8'" in err and "'int8'" in err


def test_serve_passes_the_kv_cache_dtype_to_the_engine():
    from serving.cli.serve import check_flags, server_settings

    def options(*flags: str) -> dict:
        args = build_parser().parse_args(["serve", *flags])
        check_flags(args)
        return server_settings(args).engine_options
    assert options("--kv-cache-dtype", "int8")["cache_dtype"] == "int8"
    assert "cache_dtype" not in options() and "cache_dtype" not in options(
        "--kv-cache-dtype", "auto")


def _same(a, b) -> None:
    a, b = nnx.to_pure_dict(a), nnx.to_pure_dict(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("mode, dtype", [("int8", np.int8), ("int4", np.uint8)])
def test_convert_stores_quantized_weights_and_loads_them_without_the_flag(tmp_path, mode,
                                                                        dtype):
    from devtools.hf_models import build_tiny_checkpoint
    from metrale_jax.weights.checkpoint import load_checkpoint
    tiny = build_tiny_checkpoint(tmp_path / "hf")
    assert main(["convert", str(tiny), str(tmp_path / mode), "--quantization", mode]) == 0
    stored = load_checkpoint(tmp_path / mode)
    assert stored.config.quantization == mode
    assert nnx.to_pure_dict(stored.params)["blocks"]["mlp"]["gate"].dtype == dtype
    at_load = load_checkpoint(tiny, quantization=mode)
    _same(stored.params, at_load.params)
    # a float orbax checkpoint quantized while loading gives the same arrays
    assert main(["convert", str(tiny), str(tmp_path / "float")]) == 0
    _same(load_checkpoint(tmp_path / "float", quantization=mode).params, at_load.params)
