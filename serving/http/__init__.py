"""The OpenAI-compatible HTTP server: Quart on Hypercorn (`server.py`), the app and its hooks
(`app.py`), one module per API group under `routes/`, the protocol, streaming, tool calls and
reasoning. A thin async layer over `metrale_jax.scheduler` that never touches JAX; may import
metrale_jax and serving.progress, never serving.cli (nor rich, textual or matplotlib).
"""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax", "serving.progress")
