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

from pathlib import Path

from aiohttp import web

from tokenyard.api.admin import add_admin_routes
from tokenyard.api.admin_schemas import admin_schema_middleware
from tokenyard.api.anthropic.routes import add_anthropic_routes
from tokenyard.api.batch import install as install_batches
from tokenyard.api.context import KEY, PIPELINE, STATE, AppState
from tokenyard.api.convert import now
from tokenyard.api.dashboard import add_dashboard_routes
from tokenyard.api.edge import EDGE, Edge
from tokenyard.api.fleet_admin import add_fleet_routes
from tokenyard.api.images import admit_images
from tokenyard.api.lora_routes import add_lora_routes
from tokenyard.api.mcp_admin import add_mcp_admin_routes
from tokenyard.api.middleware import middleware
from tokenyard.api.models import add_model_routes
from tokenyard.api.moderation import install as install_moderation
from tokenyard.api.openai.embeddings import add_embeddings_routes
from tokenyard.api.openai.moderations import add_moderation_routes
from tokenyard.api.openai.routes import add_openai_routes
from tokenyard.api.ops import add_ops_routes
from tokenyard.api.requests import add_request_routes
from tokenyard.api.responses.background_run import install as install_background
from tokenyard.api.responses.compact import add_compact_route
from tokenyard.api.responses.routes import add_responses_routes
from tokenyard.api.responses.stored import add_stored_response_routes
from tokenyard.api.web import add_web_routes
from tokenyard.deployments import BalancerSpec, DeploymentSpec
from tokenyard.errors import not_found
from tokenyard.gateway.admin import Admin
from tokenyard.gateway.auth import require_admin
from tokenyard.gateway.kinds import build_served, replica_client
from tokenyard.gateway.pipeline import Pipeline
from tokenyard.gateway.served import Served

__all__ = ["AppState", "Served", "build_served", "build_state", "make_app"]


async def build_state(
    replica_url: str, model: str | None, cache_dir: Path, *, replica_token: str | None = None,
    balancer: BalancerSpec | None = None,
) -> AppState:
    """The state of one running replica serving `model` (its own name), no aliases.
    `replica_token`: the replica's shared secret (TOKENYARD_REPLICA_TOKEN)."""
    client = replica_client(replica_url, token=replica_token)
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
    app = web.Application(middlewares=[middleware, admin_schema_middleware],
                          client_max_size=state.max_body_bytes)
    app[STATE] = state
    pipeline = app[PIPELINE] = Pipeline(state, images=admit_images)
    app[EDGE] = Edge(state.edge)
    add_openai_routes(app)
    add_embeddings_routes(app)
    add_anthropic_routes(app)
    add_model_routes(app)  # GET /v1/models, /v1/models/{model_id}: both dialects
    add_responses_routes(app)  # POST /v1/responses
    add_ops_routes(app)
    add_request_routes(app)  # GET /v1/requests/{id}
    add_admin_routes(app, _admin_of)
    add_fleet_routes(app)  # /admin/v1/deployments, replicas/drain; the shadow runner
    add_lora_routes(app)  # /admin/v1/deployments/{name}/adapters: LoRA at run time
    add_mcp_admin_routes(app)  # /admin/v1/…/mcp_servers: the MCP registry
    add_moderation_routes(app)  # /v1/moderations, the orgs' moderation policies
    install_moderation(app)
    add_stored_response_routes(app)  # GET /v1/responses/{id}/input_items
    install_background(app)  # GET/DELETE /v1/responses/{id}, cancel; background worker
    add_compact_route(app)  # POST /v1/responses/compact
    install_batches(app)  # /v1/files, /v1/batches, /v1/messages/batches; the batch lane
    add_web_routes(app)  # the chat page at /, the dashboard at /dashboard
    add_dashboard_routes(app)  # /admin/v1/dashboard: what the dashboard polls

    async def start_pools(app: web.Application) -> None:
        for served in app[STATE].deployments.values():
            served.pool.start()

    async def close_pools(app: web.Application) -> None:
        state = app[STATE]
        for pool in [*(s.pool for s in state.deployments.values()), *state.retired]:
            await pool.close()

    async def start_pipeline(app: web.Application) -> None:
        pipeline.start()

    async def close_pipeline(app: web.Application) -> None:
        await pipeline.close()

    app.on_startup.append(start_pools)
    app.on_startup.append(start_pipeline)
    app.on_cleanup.append(close_pipeline)
    app.on_cleanup.append(close_pools)
    return app
