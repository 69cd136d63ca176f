"""Anthropic's Messages API over the chat path: `protocol` turns a Messages request into a
`ChatCompletionRequest`, `output` builds content blocks from chat deltas and the whole
`message` body, `stream` writes the SSE events, `errors` gives errors Anthropic's shape."""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax", "serving.http")
