"""Tool calling for /v1/chat/completions.

- `parsers`: the model's output text -> content and OpenAI `tool_calls`, per model family
  (`hermes`, `llama3_json`, `mistral`), complete or streamed as chat deltas;
- `machine`, `json_scan`: the incremental machinery those parsers share;
- `request`: validation of `tools`, `tool_choice`, `parallel_tool_calls`, and history tool
  calls as chat templates want them;
- `grammar`: the Lark grammars that enforce `tool_choice` "required" and named functions.

serving/http/chat_output.py puts them together with the reasoning parsers
(serving/http/reasoning.py). Imports only metrale_jax (errors) and each other.
"""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.errors",)
