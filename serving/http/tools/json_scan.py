"""An incremental JSON validator that knows the members of the object it is reading.

Tool-call parsers read a model's output a few characters at a time. `JsonScanner` consumes
the characters of one JSON object and, after every character, knows whether the text so far
is a valid prefix of JSON (a pushdown automaton over RFC 8259's grammar: strings with escapes,
numbers, literals, nesting), whether the object is complete, and where each top-level member's
value starts and ends. So a parser can stream an `"arguments"` value while it arrives and stop
at the first character that cannot be JSON, before sending it anywhere.
"""

from __future__ import annotations

import bisect
import dataclasses
import json

_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = "\"\\/bfnrt"
_LITERALS = {"t": "true", "f": "false", "n": "null"}


@dataclasses.dataclass
class Member:
    """One top-level member of the object: its key and its value's span `[start, end)`.

    end is None while the value is still being read.
    """

    key: str
    start: int
    end: int | None = None


class JsonScanner:
    """Reads one JSON object, character by character, from its opening `{`.

    After `feed`, exactly one of these holds: `error` (the text read is no valid JSON prefix),
    `done` (the object is complete; characters after it were not consumed), or neither (more
    is needed). `text` holds what was consumed; `members` the top-level members in order.
    """

    def __init__(self) -> None:
        self._parts: list[str] = []  # the consumed text, in the chunks fed
        self._starts: list[int] = []  # where each chunk starts
        self._n = 0  # its length
        self.done = False
        self.error = False
        self.members: list[Member] = []
        self._stack: list[str] = []
        self._state = "start"
        self._key: list[str] | None = None  # raw characters of the key being read
        self._is_key = False
        self._literal = ""  # the rest of true / false / null still expected
        self._hex_left = 0
        self._member_key: str | None = None
        self._pos = 0  # the position of the character being read

    # ---- public ----------------------------------------------------------------------------
    def feed(self, chunk: str) -> int:
        """Consumes characters of `chunk` until the object ends or an error; returns how many.

        The character that makes the text invalid is not consumed (nor added to `text`).
        """
        consumed = 0
        for ch in chunk:
            if self.done or self.error:
                break
            if not self._step(ch, self._n + consumed):
                self.error = True
                break
            consumed += 1
        if consumed:
            self._starts.append(self._n)
            self._parts.append(chunk[:consumed])
            self._n += consumed
        return consumed

    @property
    def size(self) -> int:
        """How many characters were consumed."""
        return self._n

    @property
    def text(self) -> str:
        """The text consumed so far."""
        return self.span(0, self._n)

    def span(self, start: int, end: int) -> str:
        """`text[start:end]`, joined from the chunks it overlaps only (streams ask for the
        newest characters of a long value at every chunk)."""
        end = min(end, self._n)
        if start >= end:
            return ""
        i = bisect.bisect_right(self._starts, start) - 1
        out = []
        while i < len(self._parts) and self._starts[i] < end:
            a = self._starts[i]
            part = self._parts[i]
            out.append(part[max(0, start - a):end - a])
            i += 1
        return "".join(out)

    def member(self, key: str) -> Member | None:
        """The first top-level member named `key`, or None."""
        return next((m for m in self.members if m.key == key), None)

    def member_text(self, member: Member, skip: int = 0) -> str:
        """The text of a member's value read so far (all of it once `member.end` is set),
        without its first `skip` characters."""
        return self.span(member.start + skip, member.end if member.end is not None else self._n)

    def char(self, index: int) -> str:
        """The consumed character at `index`."""
        return self.span(index, index + 1)

    def value(self) -> object:
        """The decoded object (only once `done`)."""
        return json.loads(self.text)

    # ---- the automaton ---------------------------------------------------------------------
    def _step(self, ch: str, pos: int) -> bool:
        """Handles one character at `pos`; False when it cannot continue valid JSON."""
        state = self._state
        if state == "start":
            if ch != "{":
                return False
            self._stack.append("{")
            self._state = "key_or_end"
            return True
        if state in ("string", "escape", "unicode"):
            self._pos = pos
            return self._string(ch)
        if state == "literal":
            if ch != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._close_value(pos + 1)
            return True
        if state.startswith("num_"):
            ends = self._number(ch)
            if ends is None:
                return False
            if not ends:
                return True
            self._close_value(pos)  # the number ended before this character
            return self._step(ch, pos)
        if ch in _WS:
            return True
        if state in ("value", "value_or_end"):
            if state == "value_or_end" and ch == "]":
                self._stack.pop()
                self._close_value(pos + 1)
                return True
            return self._start_value(ch, pos)
        if state in ("key_or_end", "key"):
            if state == "key_or_end" and ch == "}":
                self._stack.pop()
                self._close_value(pos + 1)
                return True
            if ch != '"':
                return False
            self._state, self._is_key, self._key = "string", True, []
            return True
        if state == "colon":
            if ch != ":":
                return False
            self._state = "value"
            return True
        if state == "after":
            top = self._stack[-1]
            if ch == ",":
                self._state = "key" if top == "{" else "value"
                return True
            if (ch == "}" and top == "{") or (ch == "]" and top == "["):
                self._stack.pop()
                self._close_value(pos + 1)
                return True
        return False

    def _start_value(self, ch: str, pos: int) -> bool:
        if len(self._stack) == 1 and self._stack[0] == "{":  # a top-level member's value
            self.members.append(Member(self._member_key or "", pos))
        if ch == "{":
            self._stack.append("{")
            self._state = "key_or_end"
        elif ch == "[":
            self._stack.append("[")
            self._state = "value_or_end"
        elif ch == '"':
            self._state, self._is_key = "string", False
        elif ch == "-":
            self._state = "num_minus"
        elif ch == "0":
            self._state = "num_zero"
        elif ch in _DIGITS:
            self._state = "num_int"
        elif ch in _LITERALS:
            self._state, self._literal = "literal", _LITERALS[ch][1:]
        else:
            if len(self._stack) == 1:
                self.members.pop()
            return False
        return True

    def _string(self, ch: str) -> bool:
        state = self._state
        if state == "escape":
            if ch == "u":
                self._state, self._hex_left = "unicode", 4
            elif ch in _ESCAPES:
                self._state = "string"
            else:
                return False
        elif state == "unicode":
            if ch not in _HEX:
                return False
            self._hex_left -= 1
            if not self._hex_left:
                self._state = "string"
        elif ch == '"':
            if self._is_key:
                raw = "".join(self._key or ())
                self._member_key = json.loads(f'"{raw}"') if len(self._stack) == 1 else None
                self._key, self._is_key = None, False
                self._state = "colon"
                return True
            self._close_value(self._pos + 1)
            return True
        elif ch == "\\":
            self._state = "escape"
        elif ord(ch) < 0x20:
            return False
        if self._is_key and self._key is not None:
            self._key.append(ch)
        return True

    def _number(self, ch: str) -> bool | None:
        """The next number state for `ch`: True = the number ended before `ch`, None = error."""
        state = self._state
        digit = ch in _DIGITS
        if state == "num_minus":
            if not digit:
                return None
            self._state = "num_zero" if ch == "0" else "num_int"
        elif state in ("num_zero", "num_int", "num_frac"):
            if digit and state != "num_zero":
                return False
            if ch == "." and state != "num_frac":
                self._state = "num_dot"
            elif ch in "eE":
                self._state = "num_e"
            elif digit:  # a digit after a leading zero
                return None
            else:
                return True
        elif state == "num_dot":
            if not digit:
                return None
            self._state = "num_frac"
        elif state == "num_e":
            if ch in "+-":
                self._state = "num_esign"
            elif digit:
                self._state = "num_exp"
            else:
                return None
        elif state == "num_esign":
            if not digit:
                return None
            self._state = "num_exp"
        elif state == "num_exp":
            return not digit
        return False

    def _close_value(self, end: int) -> None:
        """A value ended at `end` (exclusive): the object is done, or a member's value is."""
        if not self._stack:
            self.done = True
            self._state = "done"
            return
        self._state = "after"
        if len(self._stack) == 1 and self.members and self.members[-1].end is None:
            self.members[-1].end = end
