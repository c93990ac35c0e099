"""The application's moderator: the pipeline's (`gateway/moderate.py` runs the stages),
started with the application, and found here by the /v1/moderations routes."""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.context import PIPELINE, STATE
from tokenyard.gateway.moderation import Moderator


def install(app: web.Application) -> None:
    """Give the application's pipeline its moderator (over the gateway's store, when there
    is one), its deployments' classifiers loaded as it starts."""

    async def start(app: web.Application) -> None:
        state = app[STATE]
        moderator = app[PIPELINE].moderator = Moderator(
            state.gateway.store if state.gateway is not None else None)
        await moderator.preload([s.spec.moderation for s in state.deployments.values()])

    async def close(app: web.Application) -> None:
        moderator = app[PIPELINE].moderator
        if moderator is not None:
            await moderator.aclose()

    app.on_startup.append(start)
    app.on_cleanup.append(close)


def moderator_of(request: web.Request) -> Moderator | None:
    return request.app[PIPELINE].moderator
