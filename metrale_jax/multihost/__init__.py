"""Multi-host serving: every process issues the same compiled engine calls, in the same order.

With `jax.distributed` one mesh spans the devices of every process, and each compiled engine
program is a collective: every process must run it, with the same host inputs, in the same
order. Process 0, the leader, owns HTTP and the batching loop (`Scheduler`): it alone decides
each iteration's admissions (slot, prompt ids, sampling settings with their seeds already
drawn) and frees (the active-slot mask of each step). The other processes, the followers,
repeat those calls on their own engines and never read an output.

How the decisions travel: a TCP side channel from the leader. `LeaderEngine` (leader.py) wraps
the leader's engine: each call that runs a compiled program (`init_decode_state`, `add`,
`step`, ...) is first sent to every follower as one length-prefixed JSON message with its
arguments (wire.py), then run; `run_follower` (follower.py) receives the calls and makes them.
Why not `multihost_utils.broadcast_one_to_all` of a fixed-size buffer every iteration:
- a decision has no fixed size (prompts, logit biases, bad words, grammar masks); a device
  broadcast needs a padded buffer per call and is one more collective per iteration;
- a closed TCP connection is the fastest sign that a peer died: the kernel closes a dead
  process's sockets at once, whereas a collective with a dead peer blocks or fails silently,
  and jax's coordination service notices only after its heartbeat timeout.
`broadcast_one_to_all` runs once, at start-up, to hand every process a random token of the
leader's; followers present it when they connect, and the leader accepts no one else.

Where (channel.py): the leader listens on the jax.distributed coordinator's host (process
0's), one port above the coordinator's (`--coordinator gpu1:8476` -> side channel on
gpu1:8477).

Failure: when a follower's connection closes (or a send to it fails) the leader calls its
`on_lost` callback with a `PeerLostError`; the server fails every in-flight and waiting
request with it and exits with `EXIT_PEER_LOST` (`exit_soon`, exits.py). A follower whose
leader connection closes gets `PeerLostError` out of `run_follower` and exits the same way.
Exits are `os._exit`: the loop thread may be stuck in a collective with the dead peer, and
jax.distributed's shutdown barrier would wait for it.

Followers keep at most one program's output in flight (they wait for call k-1 once call k
is issued), as the leader's loop does: XLA:CPU's collectives deadlock when many programs are
queued on its devices.

May import engine and errors; never scheduler, weights, text or serving (the scheduler is
handed a `LeaderEngine` as its engine; a follower is handed the function that reads a LoRA
adapter, `run_follower(..., load_adapter=...)`).
"""

from metrale_jax.multihost.channel import (
    CONNECT_TIMEOUT_S,
    STOP_TIMEOUT_S,
    FollowerChannel,
    LeaderChannel,
    connect,
    side_channel_address,
)
from metrale_jax.multihost.exits import EXIT_PEER_LOST, exit_now, exit_soon
from metrale_jax.multihost.follower import run_follower
from metrale_jax.multihost.leader import LeaderEngine
from metrale_jax.multihost.wire import PAGE_CALLS, decode, encode

__all__ = [
    "CONNECT_TIMEOUT_S",
    "EXIT_PEER_LOST",
    "PAGE_CALLS",
    "STOP_TIMEOUT_S",
    "FollowerChannel",
    "LeaderChannel",
    "LeaderEngine",
    "connect",
    "decode",
    "encode",
    "exit_now",
    "exit_soon",
    "run_follower",
    "side_channel_address",
]

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.engine", "metrale_jax.errors")
