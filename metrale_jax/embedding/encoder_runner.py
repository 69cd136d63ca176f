"""`EncoderRunner`: a BERT-family encoder in its own bucketed programs, fed by a worker thread
that batches every caller's inputs together.

Each program runs the encoder over R inputs of up to S tokens (an (R, S) of the
`BucketGrid`) and returns one row per input: the pooled (and maybe L2-normalized) vector for
an embedding model, the classification logit through its activation for a cross-encoder. Pooling and
normalization are inside the program, so only `[R, E]` floats come back to the host.

Callers (`run`, any thread) put their inputs on a queue and wait; the worker takes every
input waiting, sorts them by length and cuts them into batches over the grid
(`BucketGrid.plan`), so many inputs in one call and many calls at once share programs. A row
never sees another row (attention and pooling are per row, pads masked): a vector does not
depend on its batch company or bucket beyond float rounding of the matrix products.

Programs come from the engine's `ProgramCache` (compiled once per shape, counted in
`compile_count`, flat after `warmup`); JAX's persistent cache, when turned on
(`engine.programs.enable_compilation_cache`), makes a second start fast.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from metrale_jax.embedding.encoder_buckets import BucketGrid
from metrale_jax.embedding.pooling import l2_normalize, pool
from metrale_jax.engine.programs import ProgramCache, abstract, spec
from metrale_jax.models.bert import BertEncoder

log = logging.getLogger(__name__)


SCORE_ACTIVATIONS = {"sigmoid": jax.nn.sigmoid, "identity": lambda x: x, "tanh": jnp.tanh}


def encoder_program(graphdef: nnx.GraphDef, pooling: tuple[str, ...], normalize: bool,
                    activation: str, state: Any, ids: jax.Array, types: jax.Array,
                    lens: jax.Array) -> jax.Array:
    """One batch: ids, types `[R, S] int32` (right-padded), lens `[R] int32` -> `[R, X]`
    float32: the pooled vectors (X = E * modes) when `pooling`, else the cross-encoder's
    logits through `activation` (X = num_labels)."""
    model = nnx.merge(graphdef, state)
    hidden = model(ids, types, lens)
    if not pooling:
        return SCORE_ACTIVATIONS[activation](model.classify(hidden))
    vectors = pool(hidden, lens, pooling)
    return l2_normalize(vectors) if normalize else vectors


@dataclasses.dataclass
class _Job:
    """One caller's inputs and, once the worker is done, its result or error."""

    inputs: list[tuple[Sequence[int], Sequence[int] | None]]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: np.ndarray | None = None
    error: BaseException | None = None


class EncoderRunner:
    """The encoder's programs and the worker thread that batches callers' inputs.

    model: the `BertEncoder` (params moved to the first device); pooling: the pooling modes
    (empty: a cross-encoder, scores out); normalize: L2-normalize the pooled vectors;
    activation: a cross-encoder's score of its logit (`SCORE_ACTIVATIONS`); grid: the
    program shapes. Attributes: grid, out_dim X (the width of a result row)."""

    def __init__(self, model: BertEncoder, pooling: Sequence[str], normalize: bool,
                 grid: BucketGrid, activation: str = "sigmoid"):
        self.grid = grid
        self.pooling = tuple(pooling)
        cfg = model.cfg
        self.out_dim = cfg.hidden_size * len(self.pooling) if self.pooling else cfg.num_labels
        mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        replicated = NamedSharding(mesh, PartitionSpec())
        graphdef, state = nnx.split(model)
        self._state = jax.device_put(state, replicated)
        self._state_spec = abstract(self._state)
        self._fn = jax.jit(functools.partial(encoder_program, graphdef, self.pooling, normalize,
                                             activation))
        self.cache = ProgramCache(replicated)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="metrale-encoder", daemon=True)
        self._worker.start()

    @property
    def compile_count(self) -> int:
        """Programs compiled so far."""
        return self.cache.compile_count

    def program(self, rows: int, length: int) -> Any:
        """The compiled program for R = rows inputs of S = length tokens."""
        i32 = jnp.int32
        return self.cache.compile(("encoder", rows, length), self._fn, self._state_spec,
                                  spec((rows, length), i32), spec((rows, length), i32),
                                  spec((rows,), i32))

    def warmup(self, workers: int = 1) -> float:
        """Compiles every program of the grid; returns the seconds taken."""
        jobs = [functools.partial(self.program, r, s) for r, s in self.grid.shapes()]
        return self.cache.warmup(jobs, workers)

    def run(self, inputs: Sequence[tuple[Sequence[int], Sequence[int] | None]]) -> np.ndarray:
        """Results `[N, X] float32` of N inputs, each (ids, token types or None for all 0),
        1 .. the largest length bucket tokens. Blocks until the worker has run them (batched
        with other callers' inputs). Raises RuntimeError after `close`."""
        if self._closed:
            raise RuntimeError("the encoder runner is closed")
        if not inputs:
            return np.zeros((0, self.out_dim), np.float32)
        job = _Job(list(inputs))
        self._queue.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def close(self) -> None:
        """Stops the worker (inputs already queued are run first); `run` raises after."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._worker.join()
            while True:  # a caller that raced `close` hears of it instead of waiting forever
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.error = RuntimeError("the encoder runner is closed")
                    job.done.set()

    # ---- the worker ------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            stop = False
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
            try:
                self._run_jobs(jobs)
            except BaseException as e:  # every caller hears of it; the worker goes on
                log.exception("encoder batch failed")
                for j in jobs:
                    j.error = e
            for j in jobs:
                j.done.set()
            if stop:
                return

    def _run_jobs(self, jobs: list[_Job]) -> None:
        flat = [item for j in jobs for item in j.inputs]
        out = np.zeros((len(flat), self.out_dim), np.float32)
        pending = []  # dispatched batches: the host fills the next while the device runs
        for R, S, indices in self.grid.plan([len(ids) for ids, _ in flat]):
            ids = np.zeros((R, S), np.int32)
            types = np.zeros((R, S), np.int32)
            lens = np.zeros((R,), np.int32)
            for row, i in enumerate(indices):
                tokens, token_types = flat[i]
                n = len(tokens)
                ids[row, :n] = tokens
                if token_types is not None:
                    types[row, :n] = token_types
                lens[row] = n
            pending.append((indices, self.program(R, S)(self._state, ids, types, lens)))
        for indices, result in pending:
            out[indices] = np.asarray(result)[:len(indices)]
        at = 0
        for j in jobs:
            j.result = out[at:at + len(j.inputs)]
            at += len(j.inputs)


__all__ = ["SCORE_ACTIVATIONS", "EncoderRunner", "encoder_program"]
