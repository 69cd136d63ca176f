"""Stop strings over streamed text: hold back what may be the start of a stop string."""

from __future__ import annotations


class StopChecker:
    """Scans text deltas for stop strings.

    `feed(delta) -> (text to emit now, matched stop string or None)`. Text that could still
    turn into a stop string is held back; `flush()` returns it once generation ends without a
    match. After a match nothing more is emitted.
    """

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self._pending = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Adds `delta`; returns the text that is safe to emit and the stop string matched."""
        if self.matched is not None:
            return "", self.matched
        if not self.stops:
            return delta, None
        buf = self._pending + delta
        first: tuple[int, str] | None = None
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, stop)
        if first is not None:
            i, stop = first
            self.matched = stop
            self._pending = ""
            return buf[: i + len(stop)] if self.include_stop else buf[:i], stop
        hold = 0
        for stop in self.stops:  # the longest suffix of buf that starts some stop string
            for n in range(min(len(stop) - 1, len(buf)), hold, -1):
                if stop.startswith(buf[-n:]):
                    hold = n
                    break
        self._pending = buf[len(buf) - hold:]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """The held-back text, for when generation ends without a stop string."""
        out, self._pending = self._pending, ""
        return "" if self.matched is not None else out
