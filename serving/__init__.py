"""Metrale's front ends over `metrale_jax`: the OpenAI-compatible HTTP server (`serving.http`)
and the `metrale` command line (`serving.cli`), with `progress.py`, the stage-progress
callbacks both use. May import metrale_jax; nothing in metrale_jax imports serving.

    from serving.http.server import ServerThread, serve
    from serving.http.settings import ServerSettings
    serve(ServerSettings(model="default", port=8000))      # blocks; SIGTERM drains
"""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax",)
