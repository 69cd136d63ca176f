"""JSON-schema validators of OpenAI's response objects, built from the OpenAPI spec.

The spec is OpenAPI 3.0: `nullable: true` means "null allowed", which JSON Schema does not
know, so every such schema becomes `anyOf: [schema, {type: null}]`. `$ref`s resolve against the
spec's own `components/schemas`.

One known gap of the spec: `CreateCompletionResponse` serves as the stream chunk too ("both the
streamed and non-streamed response objects share the same shape") but its `finish_reason` is
not nullable, while OpenAI (and every compatible server) sends `null` until the last chunk.
`completion_chunk` is that schema with `finish_reason` nullable.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

NAMES = ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "CreateCompletionResponse", "ListModelsResponse", "Model", "ErrorResponse",
         "CreateEmbeddingResponse")


def _nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _root(spec_path: str) -> dict[str, Any]:
    with open(spec_path) as f:
        spec = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schemas = _nullable(spec["components"]["schemas"])
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    finish = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
        "anyOf": [finish, {"type": "null"}]}
    schemas["CompletionChunk"] = chunk
    return {"components": {"schemas": schemas}}


class Validators:
    """`validate(name, instance)` for the response schemas (raises ValidationError)."""

    def __init__(self, spec_path: Path):
        root = _root(str(spec_path))
        cls = jsonschema.Draft202012Validator
        self._validators = {
            name: cls({**root, "$ref": f"#/components/schemas/{name}"})
            for name in (*NAMES, "CompletionChunk")}

    def validate(self, name: str, instance: Any) -> None:
        """Raises `jsonschema.ValidationError` unless `instance` matches schema `name`."""
        self._validators[name].validate(instance)

    def chat(self, body: Any) -> None:
        """A chat.completion body."""
        self.validate("CreateChatCompletionResponse", body)

    def chat_chunk(self, chunk: Any) -> None:
        """A chat.completion.chunk."""
        self.validate("CreateChatCompletionStreamResponse", chunk)

    def completion(self, body: Any) -> None:
        """A text_completion body."""
        self.validate("CreateCompletionResponse", body)

    def completion_chunk(self, chunk: Any) -> None:
        """A streamed text_completion chunk (finish_reason may be null)."""
        self.validate("CompletionChunk", chunk)

    def error(self, body: Any) -> None:
        """An error body."""
        self.validate("ErrorResponse", body)
