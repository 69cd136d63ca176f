"""One running request on the host: its tokens, incremental text, stop checks and events."""

from __future__ import annotations

import numpy as np

from metrale_jax.sampling_fields import FIELDS
from metrale_jax.scheduler.events import Failed, Finished, Token, TokenLogprob
from metrale_jax.scheduler.repetition import RepetitionDetector
from metrale_jax.scheduler.request import GenerationRequest, RequestHandle
from metrale_jax.scheduler.stop_checker import StopChecker
from metrale_jax.scheduler.thinking import ThinkingBudget
from metrale_jax.scheduler.token_sets import bad_word_ids, breaker_ids


def _row_value(row_type: type, value):
    """A `SamplingParams` value as its `SlotSettings` field holds it (float, int or tuple;
    None stays None: the seed, which the scheduler picks)."""
    if value is None:
        return None
    return row_type(value) if row_type in (float, int) else tuple(value)


class Sequence:
    """Turns a slot's sampled ids into `Token` events and decides when the request stops.

    Stops, in order of checking after each token: eos ids (unless `ignore_eos`),
    `stop_token_ids`, stop strings (text held back while it may begin one), a repeating tail
    (`repetition_detection`: stop_reason "repetition"), `max_tokens`, and the end of the
    context (`max_len`), which ends with finish_reason "length".
    """

    def __init__(self, request: GenerationRequest, handle: RequestHandle, tokenizer,
                 eos_token_ids: tuple[int, ...], max_len: int,
                 lora: tuple[tuple[int, float], ...] = (), lora_key: str | None = None):
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
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_token_ids)
        self.repetition = (RepetitionDetector(p.repetition_detection)
                           if p.repetition_detection is not None else None)
        self.matcher = None  # the llguidance matcher of a constrained request (GrammarSlots)
        self.thinking = (ThinkingBudget(p.thinking_budget) if p.thinking_budget is not None
                         else None)
        self.num_generated = 0
        self.final: Finished | None = None
        self.token_ids: list[int] = []
        self.finished = False
        # The batching loop's bookkeeping: the engine settings (fixed at first admission,
        # seed included, so a preempted request resumes with the same ones), the tokens to
        # prefill (the prompt, plus what was generated before a preemption) and how many of
        # them are in the pages.
        self.settings = None
        self.feed: list[int] = []
        self.fed = 0
        # The prefix cache's: the root of this sequence's page keys (its isolation key), the
        # keys of its full pages so far, how many of the row's pages are shared or offered,
        # whether the row's token history is set (its first piece ran), and the prompt tokens
        # shared at the first admission (usage's cached_tokens; None until then).
        from metrale_jax.engine.prefix_cache import root_key
        # The adapters ((engine slot, weight) pairs; empty: none) change every key and value:
        # `lora_key` (which loads, at which weights) is part of the root.
        self.lora = lora
        # Beam search (scheduler._BeamGroup): the request's group and which running beam this
        # row holds now; None for every other request.
        self.beam = None
        self.beam_index = 0
        # Speculative decoding: when this sequence drafts (scheduler/ngram_draft.DraftGate).
        self.draft_gate = None
        self.cache_root = root_key(request.tenant, request.cache_salt, lora_key)
        self.page_keys: list[str] = []
        self.keyed = 0
        self.seeded = False
        self.cached_tokens: int | None = None

    @property
    def input_tokens(self) -> int:
        """The tokens the model read as input: the prompt, plus an encoder-decoder's source
        (the usage's prompt tokens)."""
        return self.prompt_len + len(self.request.source)

    def all_ids(self) -> list[int]:
        """The sequence so far: prompt ids, then the generated ids."""
        return list(self.request.prompt_ids) + self.token_ids

    def key_ids(self) -> list[int]:
        """`all_ids` as the prefix cache keys them: each image's placeholder tokens replaced
        by negative ids drawn from the image's content digest and the token's index in it,
        so a page holding an image matches only a page holding the same image there."""
        ids = self.all_ids()
        for im in self.request.images:
            base = int(im.digest[:15], 16)
            for i in range(im.length):
                ids[im.offset + i] = -1 - ((base + i) % (1 << 60))
        return ids

    def keys_for(self, count: int, page_size: int) -> list[str]:
        """The content keys of the sequence's first `count` full pages (fewer when it has
        fewer full pages), computed once each."""
        from metrale_jax.engine.prefix_cache import page_keys
        if count > len(self.page_keys):
            parent = self.page_keys[-1] if self.page_keys else self.cache_root
            self.page_keys += page_keys(self.key_ids(), page_size, parent,
                                        first=len(self.page_keys),
                                        count=count - len(self.page_keys))
        return self.page_keys[:count]

    def slot_settings(self, seed: int, first_mask: np.ndarray | None = None):
        """The engine's per-slot settings for this request (strings resolved to token ids;
        first_mask: the first token's grammar bitmask, for a constrained request)."""
        from metrale_jax.engine import SlotSettings
        p = self.request.params
        banned, words = bad_word_ids(self.tokenizer, p.bad_words) if p.bad_words else ((), ())
        breakers = (breaker_ids(self.tokenizer, p.dry_sequence_breakers)
                    if p.dry_multiplier > 0 else ())
        stop_ids = tuple(p.stop_token_ids) + (() if p.ignore_eos else self.eos_ids)
        row = {f.name: _row_value(f.row_type, getattr(p, f.name)) for f in FIELDS if f.row}
        row.update(seed=int(seed), dry_breaker_ids=breakers, stop_ids=stop_ids,
                   banned_ids=banned, bad_words=words, first_mask=first_mask)
        return SlotSettings(**row)

    def add_token(self, token_id: int, logprob: float, top_ids: np.ndarray,
                  top_logprobs: np.ndarray) -> None:
        """Handles one sampled token: posts its `Token` event and, at a stop, `Finished`."""
        if self.finished:
            return
        if self.thinking is not None:
            self.thinking.observe(token_id)
        if self.matcher is not None:
            try:
                self.matcher.consume(token_id)
            except Exception as e:  # the device sampled a token the grammar forbids
                self.finished = True
                self.handle.post(Failed(e))
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
        elif self.repetition is not None and self.repetition.push(token_id):
            self._finish("stop", "repetition")
        elif self.num_generated >= self.limit:
            self._finish("length", None)
        elif self.matcher is not None and self.matcher.is_stopped():
            self._finish("stop", None)  # the grammar is complete: only eos could follow

    def end_for_length(self) -> None:
        """Ends the request with finish_reason "length" (the KV cache cannot hold more)."""
        if not self.finished:
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
        # Held until the scheduler has freed the row (`post_final`): a client that saw its
        # request end sees its row and pages free.
        self.final = Finished(reason, self.input_tokens, self.num_generated, stop_reason, tail,
                              self.cached_tokens or 0)

    def post_final(self) -> None:
        """Posts the `Finished` event of a sequence that stopped (once; after the scheduler
        freed its row)."""
        if self.final is not None:
            self.handle.post(self.final)
            self.final = None
