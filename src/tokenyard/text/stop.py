"""Stop strings over streamed text.

Generated text arrives in deltas whose boundaries have nothing to do with where a stop string
starts, so "###" may come as "a#", "#", "#b". `StopStringMatcher` holds back any tail that could
still grow into a stop string, which guarantees that no part of a stop string is ever streamed
(unless asked to include the matched one) and that the result does not depend on how the text was
split into deltas.

The client chooses the stop strings, so the work they cost is linear in their length, never
more: `StopStrings` computes each string's Knuth-Morris-Pratt failure table once per request
(linear in the string) and is shared by the request's n matchers, and a matcher keeps, per stop
string, only how long a prefix of it the text so far ends with. Each character of text then
advances those states (amortised constant work each, since a state only falls back as far as it
rose), the held-back tail is the longest of those prefixes (shorter than the longest stop), and
no set of every prefix of every stop string is ever built.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The longest stop string a request may send (the API schemas refuse a longer one). A stop
#: string is a marker: a turn separator, a closing tag, a few words; this is far beyond any,
#: and bounds the text each completion holds back and re-reads.
MAX_STOP_LENGTH = 1024


def _failure_table(stop: str) -> list[int]:
    """`table[i]`: the length of the longest proper prefix of ``stop[: i + 1]`` that is also
    its suffix (Knuth-Morris-Pratt), where a partial match of `stop` falls back to."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class StopStrings:
    """A request's stop strings, prepared once (linear in their total length) and shared by
    the matchers of its n completions."""

    def __init__(self, stops: Iterable[str]) -> None:
        """`stops`: strings that end generation (empty ones and repeats are ignored)."""
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._tables = tuple(_failure_table(s) for s in self.stops)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def advance(self, index: int, state: int, text: str) -> tuple[int, int]:
        """Feed `text` to stop string `index` whose longest matched prefix so far is `state`
        (less than its length): (the end offset in `text` of its first complete occurrence,
        or -1; the longest prefix of it that the text then ends with)."""
        stop, table = self.stops[index], self._tables[index]
        size, first, i, end = len(stop), stop[0], 0, len(text)
        while i < end:
            if state == 0:  # nothing matched yet: skip to its first character (in C)
                i = text.find(first, i)
                if i < 0:
                    return -1, 0
            char = text[i]
            while state and stop[state] != char:
                state = table[state - 1]
            if stop[state] == char:
                state += 1
            i += 1
            if state == size:
                return i, state
        return -1, state


class StopStringMatcher:
    """Cuts a text stream at the first occurrence of any stop string."""

    def __init__(
        self, stops: StopStrings | Iterable[str], include_stop_str_in_output: bool = False
    ) -> None:
        """`stops`: strings that end generation (empty ones are ignored), or a request's
        prepared `StopStrings` shared with its other completions. With
        `include_stop_str_in_output` the matched stop string is emitted as the last text."""
        self._stops = stops if isinstance(stops, StopStrings) else StopStrings(stops)
        self._include = include_stop_str_in_output
        # Per stop string, the longest prefix of it that the text so far ends with.
        self._states = [0] * len(self._stops.stops)
        self._pending = ""
        self._matched: str | None = None
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later pushes emit nothing."""
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string that matched, if any."""
        return self._matched

    @property
    def pending(self) -> str:
        """Text held back because it might be the start of a stop string."""
        return self._pending

    def push(self, text_delta: str) -> tuple[str, str | None]:
        """Feed new text; return (text safe to emit now, the stop string matched or None)."""
        if self._stopped:
            return "", None
        if not self._stops:
            return text_delta, None
        # The stop that *ends* first is the one a character-by-character stream would have
        # hit first; on a tie the longer one (starting earlier) wins. This keeps the result
        # independent of how the text was cut into deltas.
        best: tuple[int, int, str] | None = None
        states = self._states
        for index, stop in enumerate(self._stops.stops):
            end, states[index] = self._stops.advance(index, states[index], text_delta)
            if end >= 0 and (best is None or (end, -len(stop)) < (best[0], -len(best[2]))):
                best = (end, index, stop)
        buffer = self._pending + text_delta
        if best is not None:
            end, _, stop = best
            # Each state is at most the pending tail's length, so the match starts in buffer.
            end += len(self._pending)
            self._stopped, self._matched, self._pending = True, stop, ""
            return buffer[: end if self._include else end - len(stop)], stop
        # The longest suffix that is a proper prefix of some stop must wait: shorter than the
        # longest stop string, so what is held (and re-read) per push stays bounded.
        keep = max(states)
        self._pending = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """Release held-back text when generation ends for another reason (EOS, length)."""
        if self._stopped:
            return ""
        out, self._pending = self._pending, ""
        return out
