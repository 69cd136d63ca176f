"""Turning generated ids into text one token at a time, without ever cutting a character.

Decoding each new token alone is wrong (a token may be half of a UTF-8 character, and
SentencePiece-style decoders treat the start of a text specially), and decoding everything
again at each step costs O(n). `IncrementalDetokenizer` decodes a short window instead, as vLLM
and TGI do: `prefix_text = decode(ids[start:read])` is text already sent, and
`decode(ids[start:])` minus that prefix is the new text. Both decodes see the same start, so
start-of-text effects cancel out, and each step costs O(window).

A trailing run of U+FFFD is held back: it may be an incomplete UTF-8 character, sent once the
character completes (or by `flush()` if it never does). This relies on the decoding being local,
as `Tokenizer` promises.

Invariant: the deltas of `push` plus `flush()` add up to exactly
`tokenizer.decode(generated_ids, skip_special_tokens)`, and every partial sum is a prefix of it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from metrale_jax.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 6  # prompt tokens decoded in front of the first generated ones
_TRIM_AT = 512  # forget ids this far behind the window


class IncrementalDetokenizer:
    """Streams the text of generated token ids, one id at a time.

    Args:
        tokenizer: decodes the ids.
        skip_special_tokens: leave out `tokenizer.special_ids`, as `decode(...,
            skip_special_tokens=True)` does.
        prompt_ids: the prompt the generated ids continue. Its last few ids are decoded in
            front of the generated ones, so the text is the continuation of the prompt's text;
            this differs from `decode(generated_ids)` only for tokenizers that drop the space
            of a leading `▁` (SentencePiece), where the first generated word keeps its space.
            With no prompt (the default), the text is exactly `decode(generated_ids)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = False,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = [int(i) for i in prompt_ids if not (self._skip and tokenizer.is_special(i))]
        self._ids: list[int] = context[-_PROMPT_CONTEXT:] if context else []
        self._start = 0  # window start, an index into self._ids
        self._read = len(self._ids)  # ids before this are fully sent
        self._prefix_len: int | None = None  # len(decode(ids[start:read])), computed lazily
        self._sent_in_window = 0  # chars of decode(ids[start:]) past the prefix already sent
        self._pieces: list[str] = []
        self._text: str | None = ""

    @property
    def text(self) -> str:
        """All text sent so far (the concatenation of the returned deltas)."""
        if self._text is None:
            self._text = "".join(self._pieces)
        return self._text

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "", never a broken char)."""
        token_id = int(token_id)
        if self._skip and self._tokenizer.is_special(token_id):
            return ""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return everything still held back (call once generation has ended)."""
        return self._advance(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, final: bool) -> str:
        if self._prefix_len is None:
            self._prefix_len = len(self._decode(self._ids[self._start : self._read]))
        window = self._decode(self._ids[self._start :])
        end = len(window)
        if not final:
            while end > 0 and window[end - 1] == _REPLACEMENT:
                end -= 1
        begin = self._prefix_len + self._sent_in_window
        delta = window[begin:end] if end > begin else ""
        if end < begin:
            logger.debug(
                "decoded window shrank (%d < %d chars); tokenizer is not prefix-stable", end, begin
            )
        self._sent_in_window += len(delta)
        if end == len(window) and len(self._ids) > self._read:
            # All of the window is sent: the next window starts at the ids just sent.
            self._start, self._read = self._read, len(self._ids)
            self._prefix_len, self._sent_in_window = None, 0
            if self._start >= _TRIM_AT:
                del self._ids[: self._start]
                self._read -= self._start
                self._start = 0
        if delta:
            self._pieces.append(delta)
            self._text = None
        return delta
