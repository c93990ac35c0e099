"""Stop strings over streamed text.

Generated text arrives in deltas whose boundaries have nothing to do with where a stop string
starts, so "###" may come as "a#", "#", "#b". `StopStringMatcher` holds back any tail that could
still grow into a stop string, which guarantees that no part of a stop string is ever streamed
(unless asked to include the matched one) and that the result does not depend on how the text was
split into deltas.
"""

from __future__ import annotations


class StopStringMatcher:
    """Cuts a text stream at the first occurrence of any stop string."""

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        """`stops`: strings that end generation (empty ones are ignored). With
        `include_stop_str_in_output` the matched stop string is emitted as the last text."""
        self._stops = list(dict.fromkeys(s for s in stops if s))
        self._include = include_stop_str_in_output
        # Proper prefixes of the stops: a pending tail equal to one of these must wait.
        self._prefixes = {s[:i] for s in self._stops for i in range(1, len(s))}
        self._longest_prefix = max((len(p) for p in self._prefixes), default=0)
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
        # The pending tail holds no complete stop, so only this buffer can contain a new match:
        # the work per call is proportional to the delta plus the longest stop string.
        buffer = self._pending + text_delta
        hit = self._first_match(buffer)
        if hit is not None:
            start, stop = hit
            self._stopped, self._matched, self._pending = True, stop, ""
            end = start + len(stop) if self._include else start
            return buffer[:end], stop
        keep = self._held_tail_length(buffer)
        self._pending = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """Release held-back text when generation ends for another reason (EOS, length)."""
        if self._stopped:
            return ""
        out, self._pending = self._pending, ""
        return out

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        # The stop that *ends* first is the one a character-by-character stream would have hit
        # first; on a tie the longer one (starting earlier) wins. This keeps the result
        # independent of how the text was cut into deltas.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _held_tail_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop."""
        for size in range(min(len(buffer), self._longest_prefix), 0, -1):
            if buffer[-size:] in self._prefixes:
                return size
        return 0
