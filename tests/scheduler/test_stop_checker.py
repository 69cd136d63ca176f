"""Stop strings over streamed text: held-back text, matches across deltas, flush."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from metrale_jax.scheduler.stop_checker import StopChecker


def run(deltas, stops, include=False):
    checker = StopChecker(tuple(stops), include)
    out = []
    for d in deltas:
        text, matched = checker.feed(d)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    return "".join(out) + checker.flush(), None


def test_match_split_across_deltas():
    assert run(["Hello wo", "rl", "d! and more"], ["world"]) == ("Hello ", "world")


def test_partial_prefix_is_held_then_released():
    checker = StopChecker(("STOP",))
    assert checker.feed("abc ST") == ("abc ", None)
    assert checker.feed("AR") == ("STAR", None)


def test_include_stop_string():
    assert run(["a</s", ">b"], ["</s>"], include=True) == ("a</s>", "</s>")


def test_earliest_of_several_stops_wins():
    assert run(["xx END yy STOP"], ["STOP", "END"]) == ("xx ", "END")


@given(st.text(alphabet="abS", max_size=30), st.lists(st.integers(1, 5), max_size=10),
       st.sampled_from(["SS", "aSb", "bbb"]))
def test_streamed_equals_whole(text, cuts, stop):
    """Whatever the delta boundaries, the result equals cutting the whole text at the stop."""
    deltas, i = [], 0
    for c in cuts:
        deltas.append(text[i:i + c])
        i += c
    deltas.append(text[i:])
    got = run(deltas, [stop])
    k = text.find(stop)
    assert got == ((text[:k], stop) if k >= 0 else (text, None))
