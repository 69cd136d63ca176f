"""Reading and editing the normalizer settings inside a SentencePiece `.model` file.

A `.model` file is a serialized `sentencepiece.ModelProto` (protobuf). We need two things the
`SentencePieceProcessor` API does not give: the normalizer flags (does the model prefix a space
to the text? does it squeeze whitespace?), and a copy of the model that does not prefix the
space, to encode the text that follows a special token. Instead of depending on `protobuf`,
this module reads the few wire-format fields involved:

    ModelProto.normalizer_spec = 3  (message NormalizerSpec)
    NormalizerSpec.add_dummy_prefix = 3, remove_extra_whitespaces = 4, escape_whitespaces = 5
    (all `optional bool`, default true)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from metrale_jax.errors import CheckpointError

logger = logging.getLogger(__name__)

_NORMALIZER_SPEC = 3
_ADD_DUMMY_PREFIX, _REMOVE_EXTRA_WHITESPACES, _ESCAPE_WHITESPACES = 3, 4, 5
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclass(frozen=True)
class NormalizerFlags:
    """The SentencePiece normalizer switches that change how text is split."""

    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(the varint at `data[pos:]`, the position after it)."""
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise CheckpointError("SentencePiece model is truncated (in a varint)")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def write_varint(value: int) -> bytes:
    """`value` (>= 0) as a protobuf varint."""
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def fields(data: bytes) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, start of the field, start of its value, end) for each field."""
    pos = 0
    while pos < len(data):
        start = pos
        key, pos = read_varint(data, pos)
        number, wire = key >> 3, key & 7
        value_start = pos
        if wire == _VARINT:
            _, pos = read_varint(data, pos)
        elif wire == _I64:
            pos += 8
        elif wire == _I32:
            pos += 4
        elif wire == _LEN:
            length, value_start = read_varint(data, pos)
            pos = value_start + length
        else:
            raise CheckpointError(f"SentencePiece model has an unknown wire type {wire}")
        if pos > len(data):
            raise CheckpointError("SentencePiece model is truncated")
        yield number, wire, start, value_start, pos


def normalizer_spec(proto: bytes) -> bytes:
    """The bytes of a ModelProto's `normalizer_spec` message (empty when it has none)."""
    spec = b""
    for number, wire, _, value_start, end in fields(proto):
        if number == _NORMALIZER_SPEC and wire == _LEN:
            spec += proto[value_start:end]  # repeated occurrences of a message are merged
    return spec


def normalizer_flags(proto: bytes) -> NormalizerFlags:
    """The normalizer flags of a serialized SentencePiece model."""
    spec = normalizer_spec(proto)
    values = {}
    for number, wire, _, value_start, _ in fields(spec):
        if wire == _VARINT:
            values[number] = bool(read_varint(spec, value_start)[0])  # the last one wins
    return NormalizerFlags(
        add_dummy_prefix=values.get(_ADD_DUMMY_PREFIX, True),
        remove_extra_whitespaces=values.get(_REMOVE_EXTRA_WHITESPACES, True),
        escape_whitespaces=values.get(_ESCAPE_WHITESPACES, True),
    )


def without_dummy_prefix(proto: bytes) -> bytes:
    """A copy of the serialized model whose normalizer does not prefix a space to the text."""
    spec = normalizer_spec(proto)
    kept = b"".join(
        spec[start:end] for number, _, start, _, end in fields(spec) if number != _ADD_DUMMY_PREFIX
    )
    new_spec = kept + write_varint(_ADD_DUMMY_PREFIX << 3 | _VARINT) + b"\x00"
    rest = b"".join(
        proto[start:end]
        for number, _, start, _, end in fields(proto)
        if number != _NORMALIZER_SPEC
    )
    key = write_varint(_NORMALIZER_SPEC << 3 | _LEN)
    return rest + key + write_varint(len(new_spec)) + new_spec
