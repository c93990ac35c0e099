"""A gateway process's background workers (the Batch API's lane, background responses):
made once the application starts, behind a gateway, and closed when it shuts down."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from aiohttp import web


class Lane(Protocol):
    def start(self) -> None: ...

    async def close(self, grace_s: float = ...) -> None: ...


L = TypeVar("L", bound=Lane)


def install_lane(app: web.Application, key: web.AppKey[L],
                 make: Callable[[web.Application], L | None]) -> None:
    """Start `make(app)`'s lane (None: this process runs none) with the application,
    keep it under `key`, and close it on shutdown."""

    async def start(app: web.Application) -> None:
        lane = make(app)
        if lane is not None:
            app[key] = lane
            lane.start()

    async def stop(app: web.Application) -> None:
        lane = app.get(key)
        if lane is not None:
            await lane.close()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
