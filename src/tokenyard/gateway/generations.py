"""Reading a run's generations: one to its end, several merged as they arrive, or a
call on each concurrently (the pipeline's `Run` reads its generations through these)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from tokenyard.gateway.call import Generating
from tokenyard.wire.outputs import Completion, RequestOutput

_T = TypeVar("_T")


async def single(gen: Generating) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for out in gen:
        yield 0, out


async def finished_completions(gen: Generating) -> list[Completion]:
    """Run a generation to its end, accumulating each choice."""
    completions = [Completion(index=i) for i in range(gen.params.n)]
    try:
        async for out in gen:
            for delta in out.deltas:
                completions[delta.index].add(delta)
    finally:
        await gen.close()
    return completions


async def merged(gens: Sequence[Generating]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several generations as they arrive, tagged with their position."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | Exception | None] = asyncio.Queue()

    async def pump(i: int, gen: Generating) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as exc:  # delivered to the consumer, which raises it
            await queue.put(exc)
        await queue.put(None)

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def each(
    gens: Sequence[Generating], fn: Callable[[Generating], Awaitable[_T]]
) -> list[_T]:
    """`fn(gen)` for every generation, concurrently (no task for a lone one)."""
    if len(gens) == 1:
        return [await fn(gens[0])]
    return list(await asyncio.gather(*(fn(gen) for gen in gens)))
