"""The OpenAI-compatible HTTP server (Quart on Hypercorn), its metrics and the `metrale` CLI.

    from serving.server import ServerThread, serve
    from serving.settings import ServerSettings
    serve(ServerSettings(model="default", port=8000))      # blocks; SIGTERM drains

A thin async layer over `metrale_jax.scheduler`: it validates, tokenizes, submits and streams;
it never touches JAX.
"""
