"""Stop strings over streamed deltas: matched across boundaries, never partly emitted."""

from __future__ import annotations

import random

import pytest

from tokenyard.text.stop import StopStringMatcher


def _run(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], str | None]:
    """Feed deltas until a stop matches; flush at the end as a finished generation would."""
    out: list[str] = []
    for delta in deltas:
        text, stop = matcher.push(delta)
        out.append(text)
        if stop is not None:
            return out, stop
    out.append(matcher.flush())
    return out, None


def test_stop_split_across_deltas_is_held_back_and_cut() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.push("a#") == ("a", None)
    assert matcher.push("#") == ("", None)
    assert matcher.push("#b") == ("", "###")
    assert matcher.stopped and matcher.matched == "###"


def test_nothing_is_emitted_after_a_match() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.push("done END trailing") == ("done ", "END")
    assert matcher.push("more") == ("", None)
    assert matcher.flush() == ""


def test_partial_prefix_that_is_not_a_stop_is_released() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.push("x##") == ("x", None)
    assert matcher.pending == "##"
    assert matcher.push("y") == ("##y", None)
    assert matcher.pending == ""


def test_flush_releases_held_text_when_generation_ends_otherwise() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.push("42 </ans") == ("42 ", None)
    assert matcher.flush() == "</ans"


def test_first_ending_of_several_stops_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.push("hello world") == ("hel", "lo w")


def test_overlapping_prefixes_keep_the_longest_candidate() -> None:
    # "aab" starts inside a held "aa": the held tail must be re-examined, not just its end.
    matcher = StopStringMatcher(["aab", "ab!"])
    assert matcher.push("xa") == ("x", None)
    assert matcher.push("a") == ("", None)
    assert matcher.push("a") == ("a", None)  # "aaa": only the last "aa" can still become "aab"
    assert matcher.push("b") == ("", "aab")


def test_self_overlapping_stop_is_found_after_a_false_start() -> None:
    matcher = StopStringMatcher(["abab"])
    outs, stop = _run(matcher, ["ab", "a", "bab"])
    assert ("".join(outs), stop) == ("", "abab")


def test_include_stop_str_in_output_emits_the_stop() -> None:
    matcher = StopStringMatcher(["###"], include_stop_str_in_output=True)
    assert matcher.push("a#") == ("a", None)
    assert matcher.push("##tail") == ("###", "###")


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher(["", ""])
    assert matcher.push("abc") == ("abc", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_result_does_not_depend_on_delta_boundaries(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["<|end|>", "\n\nUser:", "end", "Us"]
    text = "".join(
        rng.choice(["e", "n", "d", "<", "|", "\n", "U", "s", "x", "er:", " "]) for _ in range(60)
    )
    whole_out, whole_stop = _run(StopStringMatcher(stops), [text])
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    outs, stop = _run(StopStringMatcher(stops), pieces)
    assert ("".join(outs), stop) == ("".join(whole_out), whole_stop)
    # No emitted text ever contains (part of) the matched stop beyond the cut point.
    if stop is not None:
        assert stop not in "".join(outs)
        assert text.startswith("".join(outs) + stop)


def test_no_emitted_prefix_ever_contains_a_stop_fragment_before_the_match() -> None:
    matcher = StopStringMatcher(["STOP"])
    emitted = ""
    for ch in "abc STO STOP":
        text, stop = matcher.push(ch)
        emitted += text
        if stop:
            break
    assert emitted == "abc STO "
