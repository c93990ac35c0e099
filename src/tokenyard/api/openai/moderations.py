"""POST /v1/moderations in OpenAI's shape, and the org moderation admin routes.

`input` is a string, a list of strings, or a list of `{"type": "text", "text": …}` parts
(image parts are refused: no classifier here reads images). `model` picks the
classifier: omitted, `profanity-check` or one of OpenAI's moderation model names → the
local model (alt-profanity-check's); a deployment's name or an alias → that deployment's
configured classifier. Each result carries every category of OpenAI's list plus the
classifier's own ("profanity", a blocklist's names); the local model measures OpenAI's
`harassment` and no other, so each result lists the OpenAI categories its classifier did
not measure in `unmeasured_categories` (their false and 0.0 are placeholders the schema
requires, not findings). The input's tokens (counted with the default deployment's tokenizer) are
admitted and written to the ledger as for embeddings, under the model's name.

    POST /admin/v1/orgs/{org_id}/moderation   {input?: off|flag|block, output?: …}
    GET  /admin/v1/moderation/events?org_id=&since=&limit=
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, model_validator

from tokenyard.api.admin import admin_of, refusal
from tokenyard.api.context import KEY, REQUEST_ID, STATE, TIMELINE, read_request
from tokenyard.api.errors import schema_error
from tokenyard.api.moderation import moderator_of
from tokenyard.api.respond import json_response
from tokenyard.api.schemas import RequestModel, reject_unknown
from tokenyard.errors import INVALID_VALUE, invalid_request, not_found
from tokenyard.gateway.admin import AdminError
from tokenyard.gateway.billing import Usage
from tokenyard.gateway.gate import COMPLETED, FAILED
from tokenyard.gateway.moderation import (
    DEFAULT_SPEC,
    Classifier,
    Moderator,
    Verdict,
    org_moderation,
)

#: The local model's name, and OpenAI's model names that stand for it here.
LOCAL_MODEL = "profanity-check"
OPENAI_MODELS = frozenset({"omni-moderation-latest", "omni-moderation-2024-09-26",
                           "text-moderation-latest", "text-moderation-stable"})
#: OpenAI's categories, each present in every result.
CATEGORIES = (
    "harassment", "harassment/threatening", "hate", "hate/threatening", "illicit",
    "illicit/violent", "self-harm", "self-harm/intent", "self-harm/instructions",
    "sexual", "sexual/minors", "violence", "violence/graphic",
)
MAX_INPUTS = 2048


class TextPart(BaseModel):
    type: Literal["text", "image_url"]
    text: str | None = None


class ModerationRequest(RequestModel):
    """The body of POST /v1/moderations."""

    input: str | list[str] | list[TextPart]
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        reject_unknown(data, cls.model_fields)
        return data

    @model_validator(mode="after")
    def _inputs_present(self) -> ModerationRequest:
        if isinstance(self.input, list) and not self.input:
            raise schema_error(INVALID_VALUE, "input", "'input' must not be empty.")
        if not isinstance(self.input, str) and len(self.input) > MAX_INPUTS:
            raise schema_error(INVALID_VALUE, "input",
                               f"'input' may hold at most {MAX_INPUTS} items.")
        return self

    def texts(self) -> list[str]:
        items: list[str | TextPart] = ([self.input] if isinstance(self.input, str)
                                       else list(self.input))
        out: list[str] = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                out.append(item)
            elif item.type != "text" or item.text is None:
                raise invalid_request("Only text inputs can be moderated here.",
                                      param=f"input.{i}", code="unsupported_value")
            else:
                out.append(item.text)
        return out


async def _classifier(request: web.Request, moderator: Moderator, model: str) -> Classifier:
    """The classifier `model` names (404 for an unknown name)."""
    if model == LOCAL_MODEL or model in OPENAI_MODELS:
        return await moderator.classifier(DEFAULT_SPEC)
    state = request.app[STATE]
    deployment = state.router.resolve(model, 0.0).deployment  # 404 for an unknown name
    spec = state.deployments[deployment].spec.moderation
    return await moderator.classifier(spec or DEFAULT_SPEC)


def _result(verdict: Verdict) -> dict[str, Any]:
    categories = dict.fromkeys(CATEGORIES, False) | verdict.categories
    scores = dict.fromkeys(CATEGORIES, 0.0) | verdict.scores
    return {"flagged": verdict.flagged, "categories": categories,
            "category_scores": scores,
            "unmeasured_categories": [c for c in CATEGORIES if c not in verdict.categories],
            "category_applied_input_types": {name: ["text"] for name in categories}}


def _count_tokens(request: web.Request, texts: list[str]) -> int:
    tokenizer = request.app[STATE].default.tokenizer
    if tokenizer is None:
        return sum(max(1, len(t) // 4) for t in texts)
    return sum(len(tokenizer.encode(t)) for t in texts)


async def moderations(request: web.Request) -> web.Response:
    """POST /v1/moderations."""
    req = await read_request(request, ModerationRequest)
    texts = req.texts()
    model = req.model or LOCAL_MODEL
    moderator = moderator_of(request)
    if moderator is None:
        raise not_found("Moderation is not served here.")
    classifier = await _classifier(request, moderator, model)
    timeline, gateway = request[TIMELINE], request.app[STATE].gateway
    tokens = _count_tokens(request, texts)
    timeline.mark("tokenized")
    ticket = None
    if gateway is not None:
        ticket = await gateway.admit(
            request[KEY], model=model, endpoint=request.path,
            request_id=request[REQUEST_ID], prompt_tokens=tokens, max_tokens=0,
            timeline=timeline)
    verdicts = None
    try:
        began = time.perf_counter_ns()
        verdicts = await classifier.classify(texts)
        timeline.add("moderate", time.perf_counter_ns() - began)
    finally:
        if gateway is not None and ticket is not None:
            usage = Usage(prompt_tokens=tokens, cached_tokens=0, output_tokens=0)
            gateway.finish(ticket, usage if verdicts is not None else None,
                           COMPLETED if verdicts is not None else FAILED)
    return json_response({"id": f"modr-{uuid.uuid4().hex}", "model": model,
                          "results": [_result(v) for v in verdicts]})


# ---------------------------------------------------------------------------- admin


async def set_org_moderation(request: web.Request) -> web.Response:
    """POST /admin/v1/orgs/{org_id}/moderation: an org's policy per direction."""
    admin = admin_of(request)
    try:
        body = await request.json()
    except ValueError:
        raise invalid_request("The request body is not valid JSON.") from None
    try:
        result = await org_moderation(admin.store, request.match_info["org_id"], body,
                                      moderator_of(request))
    except AdminError as exc:
        raise refusal(exc) from None
    return web.json_response(result)


async def moderation_events(request: web.Request) -> web.Response:
    """GET /admin/v1/moderation/events: the latest flagged and blocked texts."""
    admin_of(request)
    moderator = moderator_of(request)
    query = request.query
    try:
        limit = int(query.get("limit", "100"))
    except ValueError:
        raise invalid_request("limit must be a whole number", param="limit") from None
    rows = await moderator.events(org_id=query.get("org_id"), limit=limit) if moderator else []
    return web.json_response({"data": rows}, dumps=lambda v: json.dumps(v, default=str))


def add_moderation_routes(app: web.Application) -> None:
    """POST /v1/moderations and the org moderation admin routes on `app`."""
    app.router.add_post("/v1/moderations", moderations)
    app.router.add_post("/admin/v1/orgs/{org_id}/moderation", set_org_moderation)
    app.router.add_get("/admin/v1/moderation/events", moderation_events)
