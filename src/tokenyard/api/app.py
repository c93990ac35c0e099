"""The HTTP process: OpenAI- and Anthropic-compatible routes in front of one engine replica.

This process never imports torch (DESIGN §2): it parses bodies, applies the chat template,
tokenizes once, fans a request out into its n core requests, and sends token ids to the
replica through `ReplicaClient`. The replica's per-step token deltas come back and go
through `OutputProcessor` here (detokenization, stop strings), so text work stays off the
replica's step loop.

The package, by job: `middleware` (request id, Server-Timing, authentication, body cap,
Idempotency-Key, errors in each dialect's shape), `openai/` and `anthropic/` (each
dialect's schemas, conversions, stream and routes), `respond` (the one response writer),
`sse` (the one SSE encoder), `ops` (probes, metrics, the OpenAPI document), `admin`,
`web` (the browser pages).

aiohttp.web rather than FastAPI: it was measured cheaper per request on this machine, and
every route here validates its own body with `parse_body` anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from tokenyard.api.admin import add_admin_routes
from tokenyard.api.anthropic.routes import add_anthropic_routes
from tokenyard.api.context import KEY, STATE, AppState, Served
from tokenyard.api.convert import now
from tokenyard.api.dashboard import add_dashboard_routes
from tokenyard.api.edge import EDGE, Edge
from tokenyard.api.fleet_admin import add_fleet_routes
from tokenyard.api.middleware import middleware
from tokenyard.api.moderation import install as install_moderation
from tokenyard.api.openai.embeddings import add_embeddings_routes
from tokenyard.api.openai.moderations import add_moderation_routes
from tokenyard.api.openai.routes import add_openai_routes
from tokenyard.api.ops import add_ops_routes
from tokenyard.api.requests import add_request_routes
from tokenyard.api.responses.routes import add_responses_routes
from tokenyard.api.responses.stored import add_stored_response_routes
from tokenyard.api.web import add_web_routes
from tokenyard.balancer.affinity import AffinityTable
from tokenyard.balancer.pool import Pool
from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.deployments import BalancerSpec, DeploymentSpec
from tokenyard.errors import not_found
from tokenyard.gateway.admin import Admin
from tokenyard.gateway.auth import require_admin
from tokenyard.text.model_files import load_tokenizer
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.replica_info import ReplicaInfo

__all__ = ["AppState", "Served", "build_served", "build_state", "make_app"]


async def build_served(
    spec: DeploymentSpec,
    clients: Sequence[tuple[str, Any]],
    cache_dir: Path,
    *,
    balancer: BalancerSpec | None = None,
    affinity: AffinityTable | None = None,
    tokenizers: dict[str | None, Tokenizer] | None = None,
) -> Served:
    """One deployment over its replicas' `clients` (id, client): an engine's model facts
    are asked of its first replica that answers, and its tokenizer is loaded (in a
    thread: a GGUF read takes seconds); an upstream gets the embedded tokenizer for its
    admission estimates. `tokenizers` shares loaded tokenizers between deployments."""
    tokenizers = {} if tokenizers is None else tokenizers
    info: ReplicaInfo | None = None
    if spec.kind == "engine":
        pool = Pool(spec.name, clients, balancer, affinity=affinity)
        info = await pool.info()
        pool.block_size = info.block_size
    else:
        pool = Pool(spec.name, clients, balancer, affinity=affinity)
    tokenizer = None
    if spec.kind != "embeddings":
        key = spec.model if spec.kind == "engine" else None
        if key not in tokenizers:
            tokenizers[key] = await asyncio.to_thread(load_tokenizer, key, cache_dir)
        tokenizer = tokenizers[key]
    if info is not None and tokenizer is not None and tokenizer.vocab_size > info.vocab_size:
        # A replica serving another model than `model` would get ids it cannot embed.
        raise ValueError(
            f"the tokenizer of {spec.model or 'the embedded model'} has "
            f"{tokenizer.vocab_size} tokens but the replica's model {info.model} only "
            f"{info.vocab_size}: pass the replica's --model"
        )
    return Served(spec, pool, now(), tokenizer, info)


async def build_state(
    replica_url: str, model: str | None, cache_dir: Path, *, replica_token: str | None = None,
    balancer: BalancerSpec | None = None,
) -> AppState:
    """The state of one running replica serving `model` (its own name), no aliases.
    `replica_token`: the replica's shared secret (TOKENYARD_REPLICA_TOKEN)."""
    client = ReplicaClient(replica_url, token=replica_token)
    try:
        info = await client.info()
        spec = DeploymentSpec(info.model, "engine", urls=(replica_url,), model=model,
                              capabilities=frozenset({"chat", "completions"}))
        served = await build_served(spec, [(replica_url, client)], cache_dir,
                                    balancer=balancer)
    except BaseException:
        await client.close()
        raise
    return AppState.single(served, now())


def _admin_of(request: web.Request) -> Admin:
    """The administrative operations, for an authenticated key with the admin scope."""
    gateway = request.app[STATE].gateway
    if gateway is None:
        raise not_found("Administration needs the gateway: this server runs with --no-auth.")
    require_admin(request[KEY])
    return Admin(gateway.store, gateway.requests)


def make_app(state: AppState) -> web.Application:
    """The aiohttp application over `state`."""
    # aiohttp's own cap sits just above ours, so an oversized body is refused while
    # reading it, and parse_body's check gives the same 413 for the rest.
    app = web.Application(middlewares=[middleware], client_max_size=state.max_body_bytes)
    app[STATE] = state
    app[EDGE] = Edge(state.edge)
    add_openai_routes(app)
    add_embeddings_routes(app)
    add_anthropic_routes(app)
    add_responses_routes(app)  # POST /v1/responses
    add_ops_routes(app)
    add_request_routes(app)  # GET /v1/requests/{id}
    add_admin_routes(app, _admin_of)
    add_fleet_routes(app)  # /admin/v1/deployments, replicas/drain; the shadow runner
    add_moderation_routes(app)  # /v1/moderations, the orgs' moderation policies
    install_moderation(app)
    add_stored_response_routes(app)  # GET/DELETE /v1/responses/{id}, its input_items
    add_web_routes(app)  # the chat page at /, the dashboard at /dashboard
    add_dashboard_routes(app)  # /admin/v1/dashboard: what the dashboard polls

    async def start_pools(app: web.Application) -> None:
        for served in app[STATE].deployments.values():
            served.pool.start()

    async def close_pools(app: web.Application) -> None:
        state = app[STATE]
        for pool in [*(s.pool for s in state.deployments.values()), *state.retired]:
            await pool.close()

    app.on_startup.append(start_pools)
    app.on_cleanup.append(close_pools)
    return app
