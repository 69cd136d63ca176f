"""The text machine behind every tool-call parser: content, calls, and the deltas they make.

A format (serving/http/tools/parsers.py) reads the model's output text through `step()`, a small
state machine over `self.buf` (text not consumed yet); this base class keeps everything the
formats share:

- Content. Text outside tool calls is content. Whitespace next to a call (before it, between
  calls, after the last) is dropped, so `"Let me check.\\n<tool_call>…"` has the content
  `"Let me check."`; everything else reaches the client unchanged. Text that may be the start
  of a marker, and trailing whitespace, are held back until the next characters decide.
- Calls. A call opens at its marker and is read with `JsonScanner`; once its name is known
  and its arguments object has begun, a header delta (index, id, type, name) goes out, then
  every character of the arguments as it arrives. Argument text is the model's own JSON text,
  sent as it is and never re-serialised: the fragments of a stream join to exactly the
  `arguments` of the complete parse.
- Failure. Text that turns out not to be a call (junk after the marker, a JSON error, a name
  that is no string, output that ends inside the call) is content: its marker becomes
  content and the text after the marker is read again (a real call after a false start is
  still found). The complete parse (`stream=False`) stages a call's deltas until the call is
  complete, so any failure is undone. A stream cannot take back what it sent: a failure is
  undone the same way while nothing of the call was sent (the usual case: junk after a
  marker shows within a few characters); after that (output cut by max_tokens inside the
  arguments) the call stays as sent and the text after the failure streams as content.

`ToolCallStream` (the streaming face) and `ToolParser.parse` (the complete one) both run this
machine; the complete parse is the stream fed all text at once.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from serving.http.tools.json_scan import JsonScanner, Member

WS = " \t\n\r"
Delta = dict[str, Any]
"""A chat delta: `{"content": str}`, or `{"tool_calls": [one tool call chunk]}`."""


def new_call_id() -> str:
    """A tool call id as OpenAI makes them: `call_` and 24 random characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _Call:
    """A call being read: what has been sent of it, and what undoes it."""

    def __init__(self, index: int, raw: str, saved_ws: str, saved_after: bool, hidden: bool):
        self.index = index
        self.raw = [raw]  # this call's text so far, marker included (read again on failure)
        self.marker_len = len(raw)  # its marker: content on failure; the rest is read again
        self.saved = (saved_ws, saved_after)
        self.hidden = hidden  # beyond max_calls: read, never shown
        self.id: str | None = None
        self.name: str | None = None
        self.header_sent = False
        self.args_sent = 0
        self.staged: list[Delta] = []
        self.committed = False  # something of it has reached the client
        self.args_text = ""  # its arguments text so far

    @property
    def signature(self) -> str:
        """Name and arguments text so far: two calls are repeats when theirs are equal."""
        return f"{self.name}\x00{self.args_text}"


class ToolCallMachine:
    """The shared machinery; a format subclass implements `step` (and sets `markers`).

    Args:
        stream: True sends a call's deltas as they are made; False stages them until the call
            is complete (the complete parse).
        max_calls: calls beyond this many are read and dropped (`parallel_tool_calls=false`
            is 1); None = no limit.
        new_id: makes tool call ids.
        unique: a call that repeats an earlier call of the answer (the same name and the same
            arguments text) is read and dropped. A stream holds a call's deltas back while
            what it has read so far could still be such a repeat, and sends them as soon as
            it differs.
        forced: the output is a forced tool choice's (a grammar allowed nothing but calls): a
            call or a marker the output cut short (`<tool_` at max_tokens) is dropped, never
            content. (Otherwise every character that is no call reaches the content.) And the
            answer is `done` at the first call that repeats an earlier one (with `unique`) or
            that opens beyond `max_calls`: the generation can end there (serving/http/
            generation.py stops it), nothing after it could reach the answer.
    """

    markers: tuple[str, ...] = ()
    text_state = "text"  # the state that reads text after a failed call
    complete_state: str | None = None  # a call open in this state is whole at end of text
    arg_keys: tuple[str, ...] = ("arguments", "parameters")
    args_optional = True  # a call without arguments gets "{}"

    def __init__(self, *, stream: bool, max_calls: int | None = None,
                 new_id: Callable[[], str] = new_call_id, unique: bool = False,
                 forced: bool = False):
        self.stream = stream
        self.max_calls = max_calls
        self.new_id = new_id
        self.unique = unique
        self.forced = forced
        self._seen: list[str] = []  # the signatures of the calls closed so far
        self.buf = ""
        self.final = False
        self.state = "text"
        self.calls = 0  # indices given so far
        self.call: _Call | None = None
        self.scanner: JsonScanner | None = None
        self._out: list[Delta] = []
        self._ws = ""  # trailing whitespace of content, held back
        self._after_call = False  # drop the leading whitespace of the next content
        self.done = False  # forced: the answer can hold nothing more (see `forced`)

    # ---- driving ---------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        """Reads more output text; returns the deltas it completes."""
        self.buf += text
        while self.step():
            pass
        return self._take()

    def finish(self) -> list[Delta]:
        """The output ended: decides everything held back; returns the last deltas."""
        self.final = True
        while True:
            while self.step():
                pass
            if self.call is None:
                break
            self.end_of_text()
        if self.buf:
            self.content(self.buf)
            self.buf = ""
        if self._ws and not self._after_call:
            self._emit({"content": self._ws})
        self._ws = ""
        return self._take()

    def step(self) -> bool:
        """Consumes some of `buf`; True when it made progress, False when it needs more."""
        raise NotImplementedError

    def end_of_text(self) -> None:
        """The text ended inside a call: it is complete in `complete_state`, else it fails."""
        if self.complete_state is not None and self.state == self.complete_state:
            self.close_call()
        else:
            self.fail()
        self.state = self.text_state

    def _fail(self) -> bool:
        """`step`'s way out when the open call turns out to be none (see `fail`)."""
        self.fail()
        self.state = self.text_state
        return True

    # ---- content ---------------------------------------------------------------------------
    def content(self, text: str) -> None:
        """Text outside calls (whitespace next to calls dropped, trailing whitespace held)."""
        if self._after_call:
            text = text.lstrip(WS)
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        body = text.rstrip(WS)
        self._ws = text[len(body):]
        if body:
            self._emit({"content": body})

    def text_until(self, marker: str) -> bool:
        """Content up to `marker`; True once the marker is next in `buf` (not consumed)."""
        i = self.buf.find(marker)
        if i >= 0:
            self.content(self.buf[:i])
            self.buf = self.buf[i:]
            return True
        keep = partial_suffix(self.buf, marker)
        cut = 0
        if self.final:  # a marker cut short by the end of the output is no content
            cut, keep = (keep if self.forced else 0), 0
        self.content(self.buf[:len(self.buf) - keep - cut])
        self.buf = self.buf[len(self.buf) - keep:] if keep else ""
        return False

    # ---- steps shared by the formats ---------------------------------------------------------
    def open_at(self, marker: str, then: str) -> bool:
        """A text state whose calls start at `marker`: content up to it, then a call opens
        (state `then`). False while more text is needed."""
        if not self.buf or not self.text_until(marker):
            return False
        self.buf = self.buf[len(marker):]
        self.open_call(marker)
        self.state = then
        return True

    def start_object(self) -> bool:
        """The open call's JSON object comes next (after whitespace): its scan starts (state
        "object"), or, when something else comes, the call fails."""
        if not self.skip_ws():
            return False
        if self.buf[0] != "{":
            return self._fail()
        self.scanner, self.state = JsonScanner(), "object"
        return True

    def scan_object(self, then: str) -> bool:
        """The "object" state: scans; a whole, valid call moves to state `then`, an invalid
        one fails."""
        result = self.scan()
        if result == "more":
            return False
        if result == "error" or not self.complete_call():
            return self._fail()
        self.state = then
        return True

    # ---- calls -----------------------------------------------------------------------------
    def open_call(self, raw: str = "") -> None:
        """A call starts; `raw` is its text already consumed (its marker)."""
        hidden = self.max_calls is not None and self.calls >= self.max_calls
        self.done = self.done or (hidden and self.forced)
        self.call = _Call(self.calls, raw, self._ws, self._after_call, hidden)
        self._ws, self._after_call = "", False

    def consume(self, n: int) -> str:
        """Moves `n` characters of `buf` into the open call's text."""
        taken, self.buf = self.buf[:n], self.buf[n:]
        if self.call is not None:
            self.call.raw.append(taken)
        return taken

    def skip_ws(self) -> bool:
        """Consumes whitespace; True when a non-whitespace character is next."""
        n = len(self.buf) - len(self.buf.lstrip(WS))
        self.consume(n)
        return bool(self.buf)

    def scan(self) -> str:
        """Feeds `buf` to the scanner of the open call: "done", "error" or "more"."""
        assert self.scanner is not None and self.call is not None
        self.consume(self.scanner.feed(self.buf))
        if self.scanner.error:
            return "error"
        if not self.progress():
            return "error"
        return "done" if self.scanner.done else "more"

    def progress(self) -> bool:
        """Sends what the scanner has read of the call so far; False when it cannot be one."""
        sc, call = self.scanner, self.call
        assert sc is not None and call is not None
        if call.name is None:
            m = sc.member("name")
            if m is not None and m.end is not None:
                name = json.loads(sc.member_text(m))
                if not isinstance(name, str) or not name:
                    return False
                call.name = name
        args = self._args_member()
        if args is not None:
            first = sc.char(args.start)
            if first not in '{"':
                return False
            if first == "{" and call.name is not None:
                self.header()
                self.arguments_after(sc.member_text(args, call.args_sent))
        return True

    def complete_call(self) -> bool:
        """The scanner finished an object: sends the rest of the call; False if it is none."""
        sc, call = self.scanner, self.call
        assert sc is not None and call is not None and sc.done
        args = self._args_member()
        if call.name is None:
            return False
        if args is None:
            if not self.args_optional:
                return False
            text = "{}"
        else:
            text = sc.member_text(args)
            if text.startswith('"'):  # arguments given as a JSON string holding an object
                text = json.loads(text)
                try:
                    if not isinstance(json.loads(text), dict):
                        return False
                except ValueError:
                    return False
        self.header()
        self.arguments(text)
        return True

    def _args_member(self) -> Member | None:
        sc = self.scanner
        assert sc is not None
        return next((m for m in sc.members if m.key in self.arg_keys), None)

    def header(self) -> None:
        """Sends the call's header delta, once."""
        call = self.call
        assert call is not None and call.name is not None
        if call.header_sent:
            return
        call.header_sent = True
        call.id = self.new_id()
        self._call_delta({"index": call.index, "id": call.id, "type": "function",
                          "function": {"name": call.name, "arguments": ""}})

    def arguments_after(self, new: str) -> None:
        """Sends `new`, the arguments text read since the last fragment."""
        call = self.call
        assert call is not None
        if new:
            self._call_delta({"index": call.index, "function": {"arguments": new}})
            call.args_sent += len(new)

    def arguments(self, text: str) -> None:
        """Sends the part of the arguments `text` (all read so far) not sent yet."""
        call = self.call
        assert call is not None
        if len(text) > call.args_sent:
            self._call_delta({"index": call.index,
                              "function": {"arguments": text[call.args_sent:]}})
            call.args_sent = len(text)

    def close_call(self) -> None:
        """The open call is complete: its deltas are final (a repeat, with `unique`, is
        dropped)."""
        call = self.call
        assert call is not None
        if self.unique and not call.hidden and not call.committed and (
                call.signature in self._seen):
            self.done = self.done or self.forced
            self.call, self.scanner = None, None
            self._after_call = True
            return
        if not call.hidden:
            self._out.extend(call.staged)
            self._seen.append(call.signature)
        self.calls += 1
        self.call, self.scanner = None, None
        self._after_call = True

    def fail(self) -> None:
        """The open call is none: its marker becomes content and the text after it is read
        again (the format sets the next state). A stream that sent some of the call abandons
        it as sent instead; what follows is read as usual."""
        call = self.call
        assert call is not None
        self.call, self.scanner = None, None
        if call.committed and not call.hidden:
            self.calls += 1
            self._after_call = True
            return
        self._ws, self._after_call = call.saved
        if self.forced and self.final:  # cut short by the end of a forced choice's output
            return
        raw = "".join(call.raw)
        self.content(raw[:call.marker_len])
        self.buf = raw[call.marker_len:] + self.buf

    def _call_delta(self, delta: dict[str, Any]) -> None:
        call = self.call
        assert call is not None
        if call.hidden:
            return
        call.args_text += delta["function"].get("arguments", "")
        if not self.stream:
            call.staged.append({"tool_calls": [delta]})
            return
        if not call.committed and self.unique and any(
                seen.startswith(call.signature) for seen in self._seen):
            call.staged.append({"tool_calls": [delta]})  # held: it may be a repeat
            return
        call.committed = True
        self._out.extend(call.staged)
        call.staged = []
        self._emit({"tool_calls": [delta]})

    # ---- output ----------------------------------------------------------------------------
    def _emit(self, delta: Delta) -> None:
        self._out.append(delta)

    def _take(self) -> list[Delta]:
        """The deltas made since the last call, neighbours of one kind merged."""
        out: list[Delta] = []
        for d in self._out:
            prev = out[-1] if out else None
            if prev is not None and "content" in d and "content" in prev:
                prev["content"] += d["content"]
            elif (prev is not None and "tool_calls" in d and "tool_calls" in prev
                  and _is_fragment(d) and _is_fragment(prev)
                  and prev["tool_calls"][0]["index"] == d["tool_calls"][0]["index"]):
                prev["tool_calls"][0]["function"]["arguments"] += (
                    d["tool_calls"][0]["function"]["arguments"])
            else:
                out.append(_copy(d))
        self._out = []
        return out


def _is_fragment(delta: Delta) -> bool:
    return "id" not in delta["tool_calls"][0]


def _copy(delta: Delta) -> Delta:
    if "tool_calls" in delta:
        call = dict(delta["tool_calls"][0])
        call["function"] = dict(call["function"])
        return {"tool_calls": [call]}
    return dict(delta)
