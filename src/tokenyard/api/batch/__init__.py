"""The Batch API, both dialects, on one lane.

    /v1/files, /v1/files/{id}[/content]        files.py: a batch's input and result files
    /v1/batches[/{id}[/cancel]]                openai.py: OpenAI's batches
    /v1/messages/batches[/{id}[/cancel|/results]]  anthropic.py: Anthropic's Message Batches

A batch's lines are stored (`gateway/batches.Batches`) and run by this process's lane
(`gateway/batch_lane.BatchLane`), which is given the one line runner of both dialects
(`runner.Runner`: a line runs as its live route runs it, through `Pipeline.run`, and
ends as a live request ends) and its settings from the serving process's config
(`AppState.batch`: `tokenyard serve`'s `--batch-*` flags over TOKENYARD_BATCH_*). A
line's price is its deployment's batch price (the fleet entry's `batch_prices`, else
half the live prices), which the pipeline reads off the deployment it routes to.
"""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.batch.anthropic import AnthropicShape, add_message_batch_routes
from tokenyard.api.batch.files import add_file_routes
from tokenyard.api.batch.http import BATCHES
from tokenyard.api.batch.openai import OpenAIShape, add_batch_routes
from tokenyard.api.batch.runner import Runner
from tokenyard.api.context import PIPELINE, STATE
from tokenyard.api.lanes import install_lane
from tokenyard.gateway.batch_lane import BatchLane
from tokenyard.gateway.batches import Batches

LANE: web.AppKey[BatchLane] = web.AppKey("tokenyard_batch_lane", BatchLane)


def install(app: web.Application) -> None:
    """The Batch API's routes on `app`, and, behind a gateway, this process's lane
    (started and stopped with the application)."""
    add_file_routes(app)
    add_batch_routes(app)
    add_message_batch_routes(app)

    def lane(app: web.Application) -> BatchLane | None:
        state = app[STATE]
        gateway = state.gateway
        if gateway is None:
            return None
        batches = app[BATCHES] = Batches(gateway.store, state.batch)
        runner = Runner(app[PIPELINE], state,
                        {"openai": OpenAIShape(), "anthropic": AnthropicShape()})
        return BatchLane(batches, runner, lambda: gateway.live_open)

    install_lane(app, LANE, lane)


__all__ = ["LANE", "install"]
