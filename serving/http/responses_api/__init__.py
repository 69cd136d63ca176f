"""OpenAI's Responses API on top of the chat machinery: `protocol` (the request and its
conversion into a `ChatCompletionRequest`), `output` (chat deltas into output items and stream
events), `store` (a bounded in-memory store of past responses)."""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax", "serving.http")
