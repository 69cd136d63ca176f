"""Anthropic's Messages API over the chat path: `protocol` turns a Messages request into a
`ChatCompletionRequest`, `output` builds content blocks from chat deltas and the whole
`message` body, `stream` writes the SSE events, `errors` gives errors Anthropic's shape."""
