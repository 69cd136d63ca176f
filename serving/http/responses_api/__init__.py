"""OpenAI's Responses API on top of the chat machinery: `protocol` (the request and its
conversion into a `ChatCompletionRequest`), `output` (chat deltas into output items and stream
events), `store` (a bounded in-memory store of past responses)."""
