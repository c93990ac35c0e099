"""n-gram prompt lookup: draft tokens found in the request's own tokens.

A reply that repeats its input (an edit, an extraction, code) has its next tokens in the
context already: find the latest earlier place where the context's last `n` tokens
occurred (the longest `n` from `max_n` down to `min_n` that matches) and propose the `k`
tokens that followed it there. No model runs; the target verifies the drafts in its next
step (verify.py) and keeps the prefix it would have sampled itself.

Each request keeps its tokens in a growing numpy buffer (`NgramState`), so a step appends
the tokens it accepted rather than converting the whole context again. The search looks
for the pattern's first token with one vectorised compare over the context, then checks
the few candidates, latest first.

`Pacer` turns speculation off for a request when it does not pay: a step that verifies
`k` drafts costs more than one that decodes one token, so a request whose recent drafts
are mostly rejected stops proposing, and tries again after a while (its text may turn
to copying later).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramConfig:
    """vLLM's `ngram` method: `prompt_lookup_min/max` and `num_speculative_tokens`."""

    k: int = 4  # drafts proposed per step
    min_n: int = 2
    max_n: int = 4
    #: Look back at most this many tokens (bounds the search on a long context).
    window: int = 4096

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes: 1 <= min_n ({self.min_n}) <= max_n ({self.max_n})")
        if self.k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, not {self.k}")


class NgramState:
    """One request's tokens, kept for lookups as they grow."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self._buf = np.zeros(max(64, 2 * len(tokens)), dtype=np.int64)
        self._len = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._len

    def extend(self, tokens: Sequence[int]) -> None:
        need = self._len + len(tokens)
        if need > len(self._buf):
            grown = np.zeros(max(need, 2 * len(self._buf)), dtype=np.int64)
            grown[:self._len] = self._buf[:self._len]
            self._buf = grown
        self._buf[self._len:need] = tokens
        self._len = need

    def truncate(self, length: int) -> None:
        """Forget the tokens from `length` on (a preempted request recomputes them)."""
        self._len = min(self._len, length)

    def propose(self, config: NgramConfig, k: int | None = None) -> list[int]:
        """Up to `k` (default `config.k`) drafts: the tokens that followed the latest
        earlier occurrence of the context's last n tokens, for the longest n that has
        one; [] when none does."""
        k = config.k if k is None else k
        end = self._len
        if k <= 0 or end < config.min_n + 1:
            return []
        lo = max(0, end - config.window)
        ctx = self._buf[lo:end]
        for n in range(min(config.max_n, len(ctx) - 1), config.min_n - 1, -1):
            pattern = ctx[-n:]
            # Starts of earlier occurrences: they end before the pattern itself does.
            starts = np.flatnonzero(ctx[:len(ctx) - n] == pattern[0])
            for start in starts[::-1]:
                if np.array_equal(ctx[start:start + n], pattern):
                    follow = ctx[start + n:start + n + k]
                    if len(follow):
                        return follow.tolist()
        return []


@dataclass
class Pacer:
    """Whether speculating pays for one request, from its recent acceptance.

    After each verified step, `record(proposed, accepted)`. Once `min_steps` steps have
    been recorded, a request whose drafts were accepted less than `min_rate` of the time
    (an exponential average from a neutral 0.5: two rejected steps) pauses for
    `pause_steps` steps. It then tries again on
    probation: one verified step decides. A step that falls short pauses it again for
    twice as long (up to `max_pause_steps`); one that passes resumes it, the pause back
    at `pause_steps`. A verify step costs several decode steps on a CPU (2.5 for k = 4
    with the embedded model), so a free-running answer must not pay `min_steps` of them
    at every retry.
    """

    min_rate: float = 0.3
    min_steps: int = 2
    pause_steps: int = 32
    max_pause_steps: int = 1024
    decay: float = 0.7
    rate: float = 0.5
    steps: int = 0
    paused: int = 0
    pause: int = 0  # the length of the last pause (0: none yet)
    probation: bool = False  # resumed after a pause: the next verified step decides

    @property
    def active(self) -> bool:
        return self.paused == 0

    def tick(self) -> None:
        """One step without speculation (paused, or nothing was found to propose)."""
        if self.paused:
            self.paused -= 1
            if self.paused == 0:
                self.rate, self.steps, self.probation = 1.0, 0, True

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        if self.probation:
            self.probation = False
            if accepted / proposed < self.min_rate:
                self.pause = min(2 * self.pause, self.max_pause_steps)
                self.paused = self.pause
                return
            self.pause = self.pause_steps
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / proposed
        self.steps += 1
        if self.steps >= self.min_steps and self.rate < self.min_rate:
            self.pause = self.pause or self.pause_steps
            self.paused = self.pause
