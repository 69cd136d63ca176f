"""The request bodies of the pooling routes as pydantic models: OpenAI's `POST /v1/embeddings`,
the Jina / Cohere rerank shape (`POST /v1/rerank`, also `/rerank` and `/v2/rerank`) and vLLM's
`POST /v1/score`. Wrong types become a 400 naming the parameter (`protocol.parse`); the
checks that need the model (lengths, token ids, `dimensions`) are serving/http/pooling.py's.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from metrale_jax.errors import InvalidParameterError
from serving.http.protocol import RequestBody, TokenIds

MAX_INPUTS = 2048
"""The most inputs (or documents, or pairs) one request may carry (OpenAI's limit)."""


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings: `input` is a string, a list of strings, a list of token ids, or a
    list of token-id lists. `dimensions` keeps the first `dimensions` entries of each vector
    (Matryoshka), re-normalized; `truncate_prompt_tokens` (vLLM's) cuts inputs longer than it
    (-1: the model's limit) instead of refusing them."""

    model: str | None = None
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: each a string or a list of token ids (400 when empty)."""
        value = self.input
        if isinstance(value, str):
            items: list[str | list[int]] = [value]
        elif value and all(isinstance(x, int) for x in value):
            items = [list(value)]  # one input of token ids
        else:
            items = list(value)  # type: ignore[arg-type]
        if not items:
            raise InvalidParameterError("input must not be empty", param="input")
        if len(items) > MAX_INPUTS:
            raise InvalidParameterError(f"input has {len(items)} items; at most {MAX_INPUTS} "
                                        "per request", param="input")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise InvalidParameterError(f"input[{i}] is empty", param="input")
        return items


class RerankDocument(BaseModel):
    """A document given as an object (Jina's and Cohere's `{"text": ...}`)."""

    model_config = ConfigDict(extra="allow")
    text: StrictStr


class RerankRequest(RequestBody):
    """POST /v1/rerank: scores each of `documents` against `query`; the results are sorted
    by relevance, the `top_n` best (all when omitted), with each document's text when
    `return_documents`."""

    model: str | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None

    def texts(self) -> list[str]:
        """The documents' texts (400 when there are none or too many)."""
        if not self.documents:
            raise InvalidParameterError("documents must not be empty", param="documents")
        if len(self.documents) > MAX_INPUTS:
            raise InvalidParameterError(f"documents has {len(self.documents)} items; at most "
                                        f"{MAX_INPUTS} per request", param="documents")
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(RequestBody):
    """POST /v1/score (vLLM's): `text_1` against `text_2`. One `text_1` scores against each
    `text_2`; two lists of the same length score pair by pair."""

    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """The (text_1, text_2) pairs in answer order (400 for lists of unequal lengths)."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not first or not second:
            raise InvalidParameterError("text_1 and text_2 must not be empty",
                                        param="text_1" if not first else "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise InvalidParameterError(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
                "or lists of the same length", param="text_2")
        if len(first) > MAX_INPUTS:
            raise InvalidParameterError(f"{len(first)} pairs; at most {MAX_INPUTS} per "
                                        "request", param="text_2")
        return list(zip(first, second, strict=True))
