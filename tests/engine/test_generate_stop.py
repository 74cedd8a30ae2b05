"""Stop-string search over streamed text deltas (no engine needed)."""

from __future__ import annotations

from workbench.engine.generate import _StopText


def feed(stops, deltas):
    s = _StopText(stops)
    out = []
    for d in deltas:
        emit, hit = s.add(d)
        out.append(emit)
        if hit:
            return out, True, s.text
    out.append(s.flush())
    return out, False, s.text


def test_stop_string_split_over_deltas_is_never_emitted():
    out, hit, text = feed(["</answer>"], ["The ans", "wer is 4<", "/ans", "wer> trailing"])
    assert hit and text == "The answer is 4"
    assert "".join(out) == text and out[1] == "wer is 4"


def test_partial_match_is_released_when_it_turns_out_not_to_be_a_stop():
    out, hit, text = feed(["\n\nUser:"], ["a\n", "\nUs", "ed it"])
    assert not hit and text == "a\n\nUsed it"
    assert out == ["a", "", "\n\nUsed it", ""]


def test_earliest_of_several_stops_wins_and_no_stops_passes_through():
    out, hit, text = feed(["xyz", "b"], ["aaxy", "zb"])
    assert hit and text == "aa"
    assert feed([], ["a", "b"]) == (["a", "b", ""], False, "ab")
