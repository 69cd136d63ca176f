"""One running request on the host: its tokens, incremental text, stop checks and events."""

from __future__ import annotations

import numpy as np

from metrale_jax.scheduler.events import Finished, Token, TokenLogprob
from metrale_jax.scheduler.request import GenerationRequest, RequestHandle
from metrale_jax.scheduler.stop_checker import StopChecker


class Sequence:
    """Turns a slot's sampled ids into `Token` events and decides when the request stops.

    Stops, in order of checking after each token: eos ids (unless `ignore_eos`),
    `stop_token_ids`, stop strings (text held back while it may begin one), `max_tokens`,
    and the end of the context (`max_len`), which ends with finish_reason "length".
    """

    def __init__(self, request: GenerationRequest, handle: RequestHandle, tokenizer,
                 eos_token_ids: tuple[int, ...], max_len: int):
        from metrale_jax.text import IncrementalDetokenizer

        self.request = request
        self.handle = handle
        p = request.params
        self.prompt_len = len(request.prompt_ids)
        self.limit = min(p.max_tokens or max_len, max_len - self.prompt_len)
        self.eos = frozenset(() if p.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(p.stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=p.skip_special_tokens)
        self.stops = StopChecker(p.stop, p.include_stop_str_in_output)
        self.num_generated = 0
        self.token_ids: list[int] = []
        self.finished = False

    def slot_settings(self, seed: int):
        """The engine's per-slot settings for this request."""
        from metrale_jax.engine import SlotSettings
        p = self.request.params
        return SlotSettings(temperature=float(p.temperature), top_k=int(p.top_k),
                            top_p=float(p.top_p), min_p=float(p.min_p), seed=int(seed))

    def add_token(self, token_id: int, logprob: float, top_ids: np.ndarray,
                  top_logprobs: np.ndarray) -> None:
        """Handles one sampled token: posts its `Token` event and, at a stop, `Finished`."""
        if self.finished:
            return
        self.num_generated += 1
        self.token_ids.append(token_id)
        p = self.request.params
        lp: tuple[TokenLogprob, ...] = ()
        if p.logprobs is not None:
            n = p.logprobs
            top = tuple((int(i), float(v)) for i, v in zip(top_ids[:n], top_logprobs[:n],
                                                          strict=True))
            lp = (TokenLogprob(token_id, logprob, top),)
        if token_id in self.eos:
            self._emit((token_id,), "", lp)
            self._finish("stop", None)
            return
        text, matched = self.stops.feed(self.detok.push(token_id))
        self._emit((token_id,), text, lp)
        if matched is not None:
            self._finish("stop", matched, flush=False)
        elif token_id in self.stop_ids:
            self._finish("stop", token_id)
        elif self.num_generated >= self.limit:
            self._finish("length", None)

    def _emit(self, ids: tuple[int, ...], text: str, lp: tuple[TokenLogprob, ...]) -> None:
        self.handle.post(Token(ids, text, lp))

    def _finish(self, reason: str, stop_reason, flush: bool = True) -> None:
        self.finished = True
        tail = ""
        if flush:
            tail, matched = self.stops.feed(self.detok.flush())
            if matched is not None:
                stop_reason = matched
            tail += self.stops.flush()
        self.handle.post(Finished(reason, self.prompt_len, self.num_generated, stop_reason,
                                  tail))
