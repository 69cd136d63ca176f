"""Ending a multi-host process whose peer died: `os._exit`, after flushing what is buffered.

A plain exit would run jax.distributed's shutdown barrier, which waits for the dead peer, and
the loop thread may be stuck in a collective with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

EXIT_PEER_LOST = 3
"""The exit status of a process whose peer died."""


def exit_soon(code: int, grace: float) -> None:
    """Ends the process with `code` after `grace` seconds (time for the error answers to
    reach clients), from a daemon timer: `os._exit`, flushing stdio and logs first."""
    timer = threading.Timer(grace, exit_now, (code,))
    timer.daemon = True
    timer.start()


def exit_now(code: int) -> None:
    """`os._exit(code)` after flushing stdio and logging handlers."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
