"""The `metrale` command line: `metrale.py` (the parser and `main`) and one module per
subcommand, with what only they use beside them (the `top` dashboard's data, `bench`'s load
generator and plots, the HTTP client of `chat`, `bench` and `top`). May import serving.http,
serving.progress and metrale_jax; nothing else imports it. Heavy imports stay inside the
commands, so `metrale --help` starts fast.
"""

from serving.cli.metrale import build_parser, main

__all__ = ["build_parser", "main"]

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax", "serving.http", "serving.progress")
