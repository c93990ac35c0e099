"""The mock replica's base: its settings, its made-up tokens, its clock, its injected
failures — what its replica-protocol routes share with its OpenAI-compatible ones.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tokenyard.wire.protocol import dumps

#: (token id in SmolLM2's vocabulary, its text): " The quick brown fox jumps over the lazy
#: dog, and the small cat sleeps in the warm sun." The tests check the ids decode so.
MOCK_TOKENS: tuple[tuple[int, str], ...] = (
    (378, " The"), (2365, " quick"), (6354, " brown"), (16438, " fox"), (27003, " jumps"),
    (690, " over"), (260, " the"), (23790, " lazy"), (2767, " dog"), (28, ","),
    (284, " and"), (260, " the"), (1165, " small"), (2644, " cat"), (2801, " sleep"),
    (99, "s"), (281, " in"), (260, " the"), (3091, " warm"), (2388, " sun"), (30, "."),
)
MOCK_MODEL = "mock"
RATE_LIMITED = "rate_limited"


@dataclass
class MockConfig:
    """Timing (ms), reply length (tokens) and injected failure probabilities (0..1)."""

    output_len: int = 16
    ttft_ms: float = 0.0
    itl_ms: float = 1.0
    inject_429: float = 0.0
    inject_503: float = 0.0
    inject_500: float = 0.0
    inject_stream_error: float = 0.0

    def __post_init__(self) -> None:
        if self.output_len < 1 or self.ttft_ms < 0 or self.itl_ms < 0:
            raise ValueError("output_len must be >= 1 and the latencies >= 0")
        failures = (self.inject_429, self.inject_503, self.inject_500, self.inject_stream_error)
        if any(not 0.0 <= p <= 1.0 for p in failures):
            raise ValueError("injected failure probabilities must be in [0, 1]")
        if self.inject_429 + self.inject_503 + self.inject_500 > 1.0:
            raise ValueError("inject_429 + inject_503 + inject_500 must be <= 1")


@dataclass
class _Run:
    """A request being generated; /stop or /abort sets `finish` (reason, stop_reason)."""

    finish: tuple[str, str | None] | None = None


class MockBase:
    """The state every route of the mock works on: one `MockConfig` (replaceable while
    serving), the failure dice, the requests running."""

    def __init__(self, config: MockConfig, seed: int = 0) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.running: dict[str, _Run] = {}
        self.num_computed_tokens = 0

    # -- shared ------------------------------------------------------------------------------
    def _length(self, max_tokens: int | None, ignore_eos: bool) -> tuple[int, str]:
        """(tokens to emit, finish reason of the last one)."""
        if max_tokens is not None and ignore_eos:
            return max(1, max_tokens), "length"
        n = self.config.output_len if max_tokens is None else min(self.config.output_len,
                                                                  max_tokens)
        n = max(1, n)
        return n, "length" if max_tokens is not None and n >= max_tokens else "stop"

    def _injected_status(self) -> int | None:
        """The status of an injected failure for this request, or None."""
        c, u = self.config, self.rng.random()
        for status, p in ((429, c.inject_429), (503, c.inject_503), (500, c.inject_500)):
            if u < p:
                return status
            u -= p
        return None

    def _fails_mid_stream(self) -> bool:
        return self.rng.random() < self.config.inject_stream_error

    async def _ticks(self, n: int, run: _Run) -> AsyncIterator[int]:
        """Token positions 0..n-1 on the mock's clock (first after ttft_ms, then every
        itl_ms, against absolute deadlines so write time does not add up); ends early
        when `run` is stopped or aborted."""
        start = time.perf_counter()
        for i in range(n):
            due = start + (self.config.ttft_ms + i * self.config.itl_ms) / 1000.0
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if run.finish is not None:
                return
            yield i


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json",
                        headers=headers)
