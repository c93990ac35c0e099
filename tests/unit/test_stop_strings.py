"""Stop strings over streamed deltas: matched across boundaries, never partly emitted, and at
a cost linear in their length (prepared once per request, shared by its n completions)."""

from __future__ import annotations

import random
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.unit.test_tokenizer import embedded_tokenizer
from tokenyard.text.output_processor import OutputProcessor
from tokenyard.text.stop import StopStringMatcher, StopStrings
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(embedded_gguf_path: Path) -> Tokenizer:
    return embedded_tokenizer(embedded_gguf_path)


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


# ---------------------------------------------------------------------------- against a reference


def _reference(stops: list[str], text: str, include: bool) -> tuple[str, str | None]:
    """Character by character: cut where a stop first ends (the longest, on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text.endswith(s, 0, end)]
        if hits:
            stop = max(hits, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


def _held(stops: list[str], text: str) -> str:
    """The longest suffix of `text` that is a proper prefix of some stop (by brute force)."""
    for size in range(len(text), 0, -1):
        if any(len(s) > size and s.startswith(text[-size:]) for s in stops):
            return text[-size:]
    return ""


@pytest.mark.parametrize("seed", range(300))
def test_matches_a_character_by_character_reference(seed: int) -> None:
    # A two- or three-letter alphabet makes stops overlap each other and themselves.
    rng = random.Random(seed)
    letters = "ab" if seed % 2 else "abc"
    stops = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 6)))
             for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choice(letters) for _ in range(rng.randint(0, 40)))
    include = seed % 3 == 0
    shared = StopStrings(stops)
    matcher = StopStringMatcher(shared, include)
    cuts = sorted(rng.sample(range(1, len(text)), min(rng.randint(0, 6), max(len(text) - 1, 0))))
    emitted, fed, stop = "", "", None
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        out, stop = matcher.push(text[a:b])
        emitted, fed = emitted + out, fed + text[a:b]
        if stop is not None:
            break
        # Nothing that could still become a stop was emitted, and nothing else was held.
        assert matcher.pending == _held(stops, fed) and emitted + matcher.pending == fed
    if stop is None:
        emitted += matcher.flush()
    assert (emitted, stop) == _reference(stops, text, include), (stops, text, cuts)


# ---------------------------------------------------------------------------- bounded work


def test_a_long_stop_costs_memory_and_time_linear_in_its_length() -> None:
    # Every prefix of a 20,000-character stop, built per completion, was 200 MB each (and
    # seconds of the event loop); the failure table is a list of its length.
    stop = "z" * 20_000
    began = time.perf_counter()
    tracemalloc.start()
    try:
        matcher = StopStringMatcher([stop])
        held = [matcher.push("z" * 100)[0] for _ in range(199)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert held == [""] * 199 and matcher.pending == "z" * 19_900
    assert matcher.push("z" * 101) == ("", stop)
    assert peak < 5_000_000, f"{peak / 1e6:.1f} MB for one 20,000-character stop"
    assert time.perf_counter() - began < 2.0


def test_a_push_rereads_no_more_than_the_held_tail() -> None:
    # A stop that almost matches over and over ("aaa…ab" against "aaa…a"): each push
    # costs the delta plus the fall-back, not the text so far or the stop's square.
    stop = "a" * 1023 + "b"
    matcher = StopStringMatcher([stop])
    began = time.perf_counter()
    for _ in range(20_000):
        assert matcher.push("a")[1] is None
    assert len(matcher.pending) == 1023
    assert matcher.push("b") == ("", stop)
    assert time.perf_counter() - began < 2.0


def test_one_request_prepares_its_stops_once_for_its_n_completions(tok: Tokenizer) -> None:
    # n completions share one StopStrings: 64 choices of a 4,096-character stop cost about
    # what one does (the old per-choice prefix sets were 8 MB each, 0.5 GB in all).
    processor = OutputProcessor(tok)
    params = SamplingParams(n=64, max_tokens=8, stop=["z" * 4096, "y" * 4096])
    tracemalloc.start()
    try:
        processor.add_request("r", tok.encode("Hello"), params)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, f"{peak / 1e6:.1f} MB to track 64 completions"
