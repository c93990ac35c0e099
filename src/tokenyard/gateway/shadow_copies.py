"""Shadow traffic: a share of an alias's requests copied to another deployment.

`tap` is the one call the pipeline makes. Without a shadow on the request's route it
returns the generations untouched (no cost). With one, it starts the copy at once in a
background task — same prompt (as the shadow's kind takes it: token ids for an engine
with the same vocabulary as the primary's tokenizer, the messages or texts for an
upstream; `gateway/kinds.py`), same sampling parameters,
the scheduler's low class, the request's own cache salt — and wraps the primary's
generations so their text is kept as it goes by. The copy is never awaited by the caller
and never billed (no ticket, no ledger row); its failures are only logged. When both
sides are done, the pair's latencies (ms from the request's start to its last token),
output tokens and whether the texts are equal go to the gateway's `ShadowRecorder`,
written off the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

from tokenyard.gateway.call import Generating, Wrapper
from tokenyard.gateway.kinds import Opening, kind_of
from tokenyard.gateway.routing import Route
from tokenyard.gateway.served import Fleet, Served
from tokenyard.gateway.shadow import ShadowRecord, ShadowRecorder
from tokenyard.wire.outputs import RequestOutput
from tokenyard.wire.sampling_params import SamplingParams

logger = logging.getLogger("tokenyard.gateway.shadow")

#: The scheduler's "low" class: a copy never runs before a caller's request.
SHADOW_PRIORITY = 1
#: A copy still running after this long is given up.
SHADOW_TIMEOUT_S = 300.0
#: Copies in flight at once; beyond it, requests are not copied (the shadow is behind).
MAX_IN_FLIGHT = 1024


class Shadows:
    """The process's copies in flight and the recorder of their results (None without a
    gateway: results are only logged)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.tasks: set[asyncio.Task[None]] = set()
        self.recorder: ShadowRecorder | None = None
        self.skipped = 0

    def start(self) -> None:
        if self.fleet.gateway is not None:
            self.recorder = ShadowRecorder(self.fleet.gateway.store)

    async def close(self) -> None:
        """Cancel the copies still running, then write the results already in."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.recorder is not None:
            await self.recorder.close()

    def launch(self, pair: _Pair) -> None:
        task = asyncio.create_task(pair.run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def record(self, record: ShadowRecord) -> None:
        if self.recorder is not None:
            self.recorder.add(record)
        else:
            logger.info("shadow %s", record)

    def tap(
        self, chosen: Route, served: Served, gens: list[Generating], request_id: str,
        prompts: Sequence[list[int]], params: Sequence[SamplingParams], *,
        messages: Sequence[Any] | None, texts: Sequence[str | None] | None,
        cache_salt: str | None,
    ) -> list[Generating]:
        """`gens` as they are when the request's route has no shadow; else start its
        copy and return the generations wrapped so their text is kept for the
        comparison."""
        if chosen.shadow is None:
            return gens
        shadow = self.fleet.deployments.get(chosen.shadow)
        if shadow is None:
            return gens
        if len(self.tasks) >= MAX_IN_FLIGHT:
            self.skipped += 1
            return gens
        copies = _copies(shadow, served, request_id, prompts, params, messages, texts,
                         cache_salt)
        if copies is None:
            logger.debug("no shadow copy of %s on %s: its prompt cannot be sent there",
                         request_id, shadow.name)
            return gens
        pair = _Pair(self, request_id, chosen.alias or served.name, served.name,
                     shadow.name, copies, len(gens))
        self.launch(pair)
        return [_Tapped(gen, pair, i) for i, gen in enumerate(gens)]


def _copies(
    shadow: Served, primary: Served, request_id: str, prompts: Sequence[list[int]],
    params: Sequence[SamplingParams], messages: Sequence[Any] | None,
    texts: Sequence[str | None] | None, cache_salt: str | None,
) -> list[Generating] | None:
    """The shadow's generations of the same prompts (None: they cannot go there)."""
    kind = kind_of(shadow.spec)
    if not kind.takes_copy(shadow, primary, messages, texts):
        return None
    return kind.open(shadow, [
        Opening(f"{request_id[:48]}-shadow-{i}", list(prompt), p, messages=messages,
                text=texts[i] if texts else None, cache_salt=cache_salt,
                priority=SHADOW_PRIORITY)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))]).gens


class _Side:
    """One side's text per (generation, choice), output tokens and end time."""

    def __init__(self, gens: int) -> None:
        self.texts: dict[tuple[int, int], list[str]] = {}
        self.tokens = [0] * gens
        self.ended = 0.0

    def add(self, position: int, out: RequestOutput) -> None:
        for delta in out.deltas:
            if delta.text:
                self.texts.setdefault((position, delta.index), []).append(delta.text)
        self.tokens[position] = out.num_output_tokens
        if out.finished:
            self.ended = max(self.ended, time.perf_counter())

    def text(self) -> dict[tuple[int, int], str]:
        return {key: "".join(parts) for key, parts in self.texts.items()}


class _Pair:
    """A request and its copy: runs the copy, waits for the primary, records both."""

    def __init__(self, shadows: Shadows, request_id: str, alias: str, primary: str,
                 shadow: str, copies: list[Generating], primaries: int) -> None:
        self.shadows = shadows
        self.request_id = request_id
        self.alias, self.primary_name, self.shadow_name = alias, primary, shadow
        self.copies = copies
        self.began = time.perf_counter()
        self.primary = _Side(primaries)
        self.shadow = _Side(len(copies))
        self.open = primaries  # primary generations not yet closed
        self.primary_ok = True
        self.primary_done = asyncio.Event()

    def closed(self, gen: Generating) -> None:
        """One primary generation closed: it counts only if it finished cleanly."""
        if gen.failed or gen.last is None or "abort" in gen.finish_reasons:
            self.primary_ok = False
        self.open -= 1
        if not self.open:
            self.primary_done.set()

    async def run(self) -> None:
        try:
            async with asyncio.timeout(SHADOW_TIMEOUT_S):
                await asyncio.gather(*(self._drain(i, gen)
                                       for i, gen in enumerate(self.copies)))
                await self.primary_done.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a copy's failure is the shadow's, never the caller's
            logger.info("shadow copy of %s on %s failed: %s", self.request_id,
                        self.shadow_name, exc)
            return
        if not self.primary_ok:
            return
        self.shadows.record(ShadowRecord(
            request_id=self.request_id[:64], created_at=datetime.now(UTC), alias=self.alias,
            primary_deployment=self.primary_name, shadow_deployment=self.shadow_name,
            primary_ms=(self.primary.ended - self.began) * 1e3,
            shadow_ms=(self.shadow.ended - self.began) * 1e3,
            primary_output_tokens=sum(self.primary.tokens),
            shadow_output_tokens=sum(self.shadow.tokens),
            texts_match=self.primary.text() == self.shadow.text(),
        ))

    async def _drain(self, position: int, gen: Generating) -> None:
        try:
            await gen.start()
            async for out in gen:
                self.shadow.add(position, out)
        finally:
            with contextlib.suppress(Exception):
                await gen.close()


class _Tapped(Wrapper):
    """A primary generation as the caller sees it, its outputs also noted in the pair."""

    def __init__(self, gen: Generating, pair: _Pair, position: int) -> None:
        super().__init__(gen)
        self._pair = pair
        self._position = position
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for out in self._gen:
            self._pair.primary.add(self._position, out)
            yield out

    async def close(self) -> None:
        try:
            await self._gen.close()
        finally:
            if not self._closed:
                self._closed = True
                self._pair.closed(self._gen)
