"""The HTTP process: OpenAI- and Anthropic-compatible routes in front of one engine replica.

This process never imports torch (DESIGN §2): it parses bodies, applies the chat template,
tokenizes once, fans a request out into its n core requests, and sends token ids to the
replica through `ReplicaClient`. The replica's per-step token deltas come back and go
through `OutputProcessor` here (detokenization, stop strings), so text work stays off the
replica's step loop.

The package, by job: `middleware` (request id, Server-Timing, authentication, body cap,
Idempotency-Key, errors in each dialect's shape), `openai/` and `anthropic/` (each
dialect's schemas, conversions, stream and routes), `respond` (the one response writer),
`sse` (the one SSE encoder), `ops` (probes, metrics, the OpenAPI document), `admin`.

aiohttp.web rather than FastAPI: it was measured cheaper per request on this machine, and
every route here validates its own body with `parse_body` anyway.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from tokenyard.api.admin import add_admin_routes
from tokenyard.api.anthropic.routes import add_anthropic_routes
from tokenyard.api.context import KEY, STATE, AppState
from tokenyard.api.convert import now
from tokenyard.api.middleware import middleware
from tokenyard.api.openai.routes import add_openai_routes
from tokenyard.api.ops import add_ops_routes
from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.errors import not_found
from tokenyard.gateway.admin import Admin
from tokenyard.gateway.auth import require_admin
from tokenyard.text.model_files import load_tokenizer

__all__ = ["AppState", "build_state", "make_app"]


async def build_state(
    replica_url: str, model: str | None, cache_dir: Path, *, replica_token: str | None = None
) -> AppState:
    """Ask the replica for its model, and load the matching tokenizer (in a thread: a
    GGUF read takes seconds and the loop may already serve other things).
    `replica_token`: the replica's shared secret (TOKENYARD_REPLICA_TOKEN)."""
    client = ReplicaClient(replica_url, token=replica_token)
    try:
        info = await client.info()
    except BaseException:
        await client.close()
        raise
    tokenizer = await asyncio.to_thread(load_tokenizer, model, cache_dir)
    if tokenizer.vocab_size > info.vocab_size:
        # A replica serving another model than `model` would get ids it cannot embed.
        await client.close()
        raise ValueError(
            f"the tokenizer of {model or 'the embedded model'} has {tokenizer.vocab_size} "
            f"tokens but the replica's model {info.model} only {info.vocab_size}: pass the "
            "replica's --model"
        )
    return AppState(client, tokenizer, info, now())


def _admin_of(request: web.Request) -> Admin:
    """The administrative operations, for an authenticated key with the admin scope."""
    gateway = request.app[STATE].gateway
    if gateway is None:
        raise not_found("Administration needs the gateway: this server runs with --no-auth.")
    require_admin(request[KEY])
    return Admin(gateway.store)


def make_app(state: AppState) -> web.Application:
    """The aiohttp application over `state`."""
    # aiohttp's own cap sits just above ours, so an oversized body is refused while
    # reading it, and parse_body's check gives the same 413 for the rest.
    app = web.Application(middlewares=[middleware], client_max_size=state.max_body_bytes)
    app[STATE] = state
    add_openai_routes(app)
    add_anthropic_routes(app)
    add_ops_routes(app)
    add_admin_routes(app, _admin_of)

    async def close_client(app: web.Application) -> None:
        await app[STATE].client.close()

    app.on_cleanup.append(close_client)
    return app
