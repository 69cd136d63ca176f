"""A follower's loop: it makes process 0's engine calls, in process 0's order."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax

from metrale_jax.errors import MetraleError, PeerLostError
from metrale_jax.multihost.channel import FollowerChannel
from metrale_jax.multihost.wire import PAGE_CALLS, decode

log = logging.getLogger(__name__)


def run_follower(engine: Any, channel: FollowerChannel,
                 load_adapter: Callable[[str, str], Any] | None = None) -> str:
    """Makes the leader's engine calls, in its order, until it says stop ("stop": the
    server ends) or unload ("unload": a server of several models let this engine go; a
    "load" of the next one follows). Returns which.

    `load_adapter(path, name)` reads the LoRA adapter the leader loaded from `path` (each
    process reads its own copy, as each loads the model), for this engine's model and rank;
    without it a LoRA load from the leader ends the follower.

    A call that raises a `MetraleError` (a request the engine refuses) raised on the leader
    too, which then resets the state itself; any other error ends the follower. Raises
    `PeerLostError` when the leader is gone.
    """
    state = None
    in_flight = None
    while True:
        message = channel.receive()
        op = message["op"]
        if op in ("stop", "unload"):
            if in_flight is not None:
                jax.block_until_ready(in_flight)
            return op
        args, kwargs = decode(message.get("args", [])), decode(message.get("kwargs", {}))
        try:
            if op == "init":  # its state is donated to the next call: wait for it now
                state = jax.block_until_ready(engine.init_decode_state())
                out: Any = None
            elif op == "add":
                state, out = engine.add(state, *args, **kwargs)
            elif op == "step":
                state, out = engine.step(state, *args, **kwargs)
            elif op == "verify":
                state, out, _ = engine.verify(state, *args, **kwargs)
            elif op == "beam_set":
                state, out = engine.beam_set(state, *args), None
            elif op == "set_lora":  # a program: runs in order, like a step
                slot, path, name = args
                adapter = None
                if path is not None:
                    if load_adapter is None:
                        raise RuntimeError("process 0 loaded a LoRA adapter, and this "
                                           "process was given no way to read one")
                    adapter = load_adapter(path, name)
                engine.set_lora(slot, adapter)
                out = None
            elif op in PAGE_CALLS:
                getattr(engine, op)(*args)
                continue
            else:
                raise PeerLostError(f"process 0 sent an unknown call {op!r}")
        except PeerLostError:
            raise
        except MetraleError as e:
            log.warning("process %d: %s refused: %s", channel.process_id, op, e.message)
            continue
        if in_flight is not None:  # the previous call's output: never donated
            jax.block_until_ready(in_flight)
        in_flight = out

