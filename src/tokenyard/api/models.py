"""GET /v1/models and GET /v1/models/{model_id}, in both dialects.

OpenAI and Anthropic publish the same two routes with different bodies: OpenAI's list is
``{"object": "list", "data": [Model]}`` (`id`, `object`, `created` in epoch seconds,
`owned_by`), Anthropic's ``{"data": [ModelInfo], "first_id", "has_more", "last_id"}``
(`type: "model"`, `id`, `display_name`, `created_at` in RFC 3339, the context and output
limits). The request says which it speaks: the official Anthropic SDK sends
`anthropic-version` on every request and authenticates with `x-api-key`; OpenAI's sends
neither. Every deployment is listed, then every alias; all fit in one page (the
Anthropic list's `limit`, `before_id` and `after_id` cut it the way that API does). Each
OpenAI card says its `region`; a regional endpoint (`serve --region`) lists only its
region's, and its list says which (`region`). Only what the request's key may use is
listed (its `models` scope, its org's and project's regions); any other model is a 404,
as one that does not exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api.context import KEY, STATE
from tokenyard.api.openai.schemas import ModelCard, ModelList
from tokenyard.api.respond import json_response
from tokenyard.api.schemas import page_limit
from tokenyard.deployments import DeploymentSpec
from tokenyard.errors import INVALID_VALUE, invalid_request, model_not_found
from tokenyard.gateway.auth import X_API_KEY
from tokenyard.gateway.kinds import kind_of
from tokenyard.sampling_defaults import SamplingDefaults

#: Anthropic's default and largest page (`limit`).
DEFAULT_LIMIT, MAX_LIMIT = 20, 1000


def speaks_anthropic(request: web.Request) -> bool:
    """Whether a models request is the Anthropic API's: it carries `anthropic-version`
    or authenticates with `x-api-key`, as the Anthropic SDK does."""
    return "anthropic-version" in request.headers or X_API_KEY in request.headers


@dataclass(frozen=True)
class Listed:
    """One listed model: a deployment or an alias, and its limits when known."""

    id: str
    created: int
    max_input_tokens: int | None = None
    max_tokens: int | None = None
    #: What it can be asked for ("chat", "completions", "embeddings", …; an alias: what
    #: every one of its targets can do).
    capabilities: tuple[str, ...] = ()
    #: A deployment's sampling defaults (None: an alias, whose deployments' are theirs).
    sampling: SamplingDefaults | None = None
    #: Where it is served (an alias: its targets' region when they share one).
    region: str | None = None
    #: A LoRA adapter's base deployment (`base:adapter`); None for any other.
    parent: str | None = None
    #: Whether its model is loaded (`Served.status`; None: an alias).
    status: str | None = None


class ModelInfo(BaseModel):
    """Anthropic's ModelInfo. `capabilities` is null: the spec's keys describe Claude's
    features (thinking, code execution, ...), which no model here reports."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str
    capabilities: None = None
    max_input_tokens: int | None = None
    max_tokens: int | None = None


class ModelInfoList(BaseModel):
    """Anthropic's ListResponse[ModelInfo]."""

    data: list[ModelInfo]
    first_id: str | None
    has_more: bool
    last_id: str | None


async def _listed(request: web.Request) -> list[Listed]:
    """Every deployment (with its context window and output cap), then every alias, that
    the request's key may use."""
    key = request.get(KEY)
    every = await _every(request)
    if key is None:  # served without keys
        return every
    fleet = request.app[STATE].router.fleet

    def usable(name: str) -> bool:
        alias = fleet.aliases.get(name)
        if alias is None:
            region = fleet.deployments[name].region if name in fleet.deployments else None
            return key.scopes.allows_model(name) and (
                key.allowed_regions is None or region in key.allowed_regions)
        # An alias: by its own name or its targets' (as `authorize` allows), in a region
        # the key may use (as routing takes its targets).
        targets = [t for t, _ in alias.routes if usable(t) or (
            key.scopes.allows_model(name) and (key.allowed_regions is None or
                                               fleet.deployments[t].region
                                               in key.allowed_regions))]
        return bool(targets)

    return [m for m in every if usable(m.id)]


async def _every(request: web.Request) -> list[Listed]:
    state = request.app[STATE]
    fleet = state.router.fleet
    windows = {name: await kind_of(s.spec).listed_window(s)
               for name, s in state.deployments.items()}
    return ([Listed(s.name, s.created, windows[name], s.spec.max_output_tokens,
                    capabilities=_capabilities([s.spec]),
                    sampling=s.sampling if s.generates else None,
                    region=s.spec.region, status=s.status, parent=s.spec.parent)
             for name, s in state.deployments.items()]
            + [Listed(name, state.created, capabilities=_capabilities(
                fleet.deployments[target] for target, _ in alias.routes),
                region=_one_region({fleet.deployments[t].region for t, _ in alias.routes}))
               for name, alias in fleet.aliases.items()])


def _one_region(regions: set[str | None]) -> str | None:
    """The one region of an alias's targets (None: several, or none declared)."""
    return next(iter(regions)) if len(regions) == 1 else None


def _capabilities(specs: Iterable[DeploymentSpec]) -> tuple[str, ...]:
    """What every one of `specs` can do, sorted."""
    return tuple(sorted(frozenset.intersection(*(spec.capabilities for spec in specs))))


def _info(model: Listed) -> ModelInfo:
    created = datetime.fromtimestamp(model.created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return ModelInfo(id=model.id, display_name=model.id, created_at=created,
                     max_input_tokens=model.max_input_tokens, max_tokens=model.max_tokens)


def _card(model: Listed) -> ModelCard:
    return ModelCard(id=model.id, created=model.created, owned_by="tokenyard",
                     max_model_len=model.max_input_tokens, max_output_tokens=model.max_tokens,
                     capabilities=list(model.capabilities),
                     sampling_defaults=None if model.sampling is None
                     else dict(model.sampling.values),
                     sampling_defaults_source=None if model.sampling is None
                     else dict(model.sampling.sources), region=model.region,
                     status=model.status, parent=model.parent)




def _page(request: web.Request, models: list[Listed]) -> ModelInfoList:
    """The page `limit`, `after_id` and `before_id` choose (Anthropic's cursors)."""
    ids = [m.id for m in models]
    limit = page_limit(request.query, DEFAULT_LIMIT, MAX_LIMIT)
    start, end = 0, len(models)
    for param in ("after_id", "before_id"):
        cursor = request.query.get(param)
        if cursor is None:
            continue
        if cursor not in ids:
            raise invalid_request(f"'{param}' names no listed model: {cursor!r}.",
                                  param=param, code=INVALID_VALUE)
        if param == "after_id":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    window = models[start:end]
    page = window[-limit:] if "before_id" in request.query and "after_id" not in request.query \
        else window[:limit]
    data = [_info(m) for m in page]
    return ModelInfoList(data=data, first_id=data[0].id if data else None,
                         last_id=data[-1].id if data else None,
                         has_more=len(page) < len(window))


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: OpenAI's list, or Anthropic's page."""
    models = await _listed(request)
    if speaks_anthropic(request):
        return json_response(_page(request, models))
    return json_response(ModelList(data=[_card(m) for m in models],
                                   region=request.app[STATE].region))


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model_id}: one model, in the request's dialect; 404 when neither a
    deployment nor an alias has that name."""
    wanted = request.match_info["model_id"]
    found = next((m for m in await _listed(request) if m.id == wanted), None)
    if found is None:
        raise model_not_found(wanted)
    body: Any = _info(found) if speaks_anthropic(request) else _card(found)
    return json_response(body)


def add_model_routes(app: web.Application) -> None:
    """GET /v1/models and GET /v1/models/{model_id} on `app`."""
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id}", get_model)
