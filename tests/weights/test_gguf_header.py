"""The fast GGUF path (`gguf_header.read_header`, gguf's row codecs on large chunks) gives
exactly what the gguf library's own reading gives (`read_gguf(..., reference=True)`:
`gguf.GGUFReader` and `gguf.quants.dequantize`): metadata values and their Python types,
tensor index and data views, config and float32 tensors bit for bit; on the default model and
on tiny GGUFs of every architecture, tensor type and metadata value type."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from metrale_jax.errors import CheckpointError
from metrale_jax.weights.gguf_header import FastPathError, TensorInfo, read_header
from metrale_jax.weights.gguf_reader import read_gguf, read_gguf_header
from tests.weights.test_gguf_reader import ALL_TYPES, SPECS, make


def typed(value):
    """`value` with the Python type of every element spelled out (1 == 1.0 == True in `==`)."""
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


def assert_same_header(path: Path) -> None:
    fast_meta, fast_tensors = read_gguf_header(path)
    ref_meta, ref_tensors = read_gguf_header(path, reference=True)
    assert list(fast_meta) == list(ref_meta)  # same keys in the same order
    assert typed(list(fast_meta.values())) == typed(list(ref_meta.values()))
    assert len(fast_tensors) == len(ref_tensors)
    for fast, ref in zip(fast_tensors, ref_tensors, strict=True):
        assert (fast.name, fast.tensor_type, fast.dims, fast.n_elements, fast.n_bytes,
                fast.data_offset) == (ref.name, ref.tensor_type, ref.dims, ref.n_elements,
                                      ref.n_bytes, ref.data_offset)
        assert (fast.data.dtype, fast.data.shape) == (ref.data.dtype, ref.data.shape), fast.name
        assert fast.data.tobytes() == ref.data.tobytes(), fast.name


def assert_same_model(path: Path) -> None:
    fast_cfg, fast, fast_meta = read_gguf(path)
    ref_cfg, ref, ref_meta = read_gguf(path, reference=True)
    assert fast_cfg == ref_cfg
    assert typed(list(fast_meta.items())) == typed(list(ref_meta.items()))
    assert list(fast) == list(ref)
    for name, want in ref.items():
        got = fast[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert got.tobytes() == want.tobytes(), name  # bit for bit, NaN payloads included


def test_the_fast_parse_reads_the_tiny_models(tmp_path):
    path, *_ = make(tmp_path)
    assert isinstance(read_header(path).tensors[0], TensorInfo)  # not the fallback


@pytest.mark.parametrize("key", list(SPECS))
def test_each_architecture_reads_as_the_library_does(tmp_path, key):
    path, *_ = make(tmp_path, key)  # 2-D tensors cycle through every supported type
    assert_same_header(path)
    assert_same_model(path)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_each_tensor_type_dequantizes_as_the_library_does(tmp_path, qtype):
    path, *_ = make(tmp_path, types=qtype)
    assert_same_model(path)


@pytest.mark.xdist_group("default-model")
@pytest.mark.default_model
def test_default_model_reads_as_the_library_does(default_gguf):
    header = read_header(default_gguf)
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    assert header.tensors[0].tensor_type in (Q.Q4_1, Q.Q8_0, Q.F32)
    assert_same_header(default_gguf)
    assert_same_model(default_gguf)


def write_every_value_type(path: Path, extra: dict | None = None) -> None:
    """A GGUF of a single F32 tensor and a metadata key of every value type (scalar and array),
    strings that are not UTF-8 among them."""
    w = gguf.GGUFWriter(str(path), "llama")
    scalars = {V.UINT8: 255, V.INT8: -128, V.UINT16: 65535, V.INT16: -32768,
               V.UINT32: 2**32 - 1, V.INT32: -2**31, V.UINT64: 2**64 - 1, V.INT64: -2**63,
               V.FLOAT32: 1e-5, V.FLOAT64: 0.1, V.BOOL: True}
    for kind, value in scalars.items():
        w.add_key_value(f"test.{kind.name.lower()}", value, kind)
        w.add_key_value(f"test.{kind.name.lower()}_array", [value, value, type(value)(0)],
                        V.ARRAY, sub_type=kind)
    w.add_key_value("test.float32_odd", 0.3, V.FLOAT32)
    w.add_key_value("test.float32_array_odd", [0.3, 1e-5, float("inf")], V.ARRAY,
                    sub_type=V.FLOAT32)
    w.add_key_value("test.string", "héllo ✓", V.STRING)
    w.add_key_value("test.bad_string", b"ok \xff\xfe", V.STRING)
    w.add_key_value("test.strings", ["a", "", "Ġthe", "日本", b"\xc3"], V.ARRAY,
                    sub_type=V.STRING)
    for key, (value, kind, sub) in (extra or {}).items():
        w.add_key_value(key, value, kind, sub_type=sub)
    w.add_tensor("t.weight", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_reads_as_the_library_does(tmp_path, caplog):
    path = tmp_path / "values.gguf"
    write_every_value_type(path)
    with caplog.at_level(logging.WARNING):
        meta = read_header(path).metadata  # the fast parse, not the fallback
    assert meta["test.float32"] == 1e-05 and meta["test.uint64"] == 2**64 - 1
    assert meta["test.bad_string"] == "ok \ufffd\ufffd"
    assert meta["test.strings"][-1] == "\ufffd"
    assert sum("not UTF-8" in r.message for r in caplog.records) == 2
    assert_same_header(path)


def test_nested_arrays_fall_back_to_the_library(tmp_path):
    path = tmp_path / "nested.gguf"
    write_every_value_type(path, {"test.nested": ([[1, 2], [3]], V.ARRAY, None)})
    with pytest.raises(FastPathError, match="nested"):
        read_header(path)
    assert_same_header(path)  # read by GGUFReader: the same as the reference


@pytest.mark.parametrize("cut", [30, 200, -1])
def test_truncated_files_fall_back_and_fail_as_before(tmp_path, cut):
    path, *_ = make(tmp_path, types=Q.Q8_0)
    data = path.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:cut])
    with pytest.raises(FastPathError):
        read_header(short)
    with pytest.raises(CheckpointError) as fast:
        read_gguf_header(short)
    with pytest.raises(CheckpointError) as ref:
        read_gguf_header(short, reference=True)
    assert str(fast.value) == str(ref.value)
