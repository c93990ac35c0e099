"""POST /v1/responses/compact: a conversation made shorter, for the client to send back
in place of the whole.

    {"model", "input"?, "previous_response_id"?, "instructions"?, ...}
      → {"id", "object": "response.compaction", "created_at", "output", "usage"}

The conversation is the items `previous_response_id` leads to, then `input`. Its last
turn (from its last user message on) is kept as it is; the turns before it are
summarised by the model into one compaction item (`compaction.py`), which comes first in
`output`, the kept items after it with their ids. The summary is one model turn through
the pipeline under the caller's key, as a live request: admitted by its limits and
balance, billed, and its `usage` is the compaction's. A conversation of one turn has
nothing older to summarise: it comes back as it is, with no usage.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from pydantic import Field, model_validator

from tokenyard.api.context import read_request
from tokenyard.api.errors import schema_error
from tokenyard.api.respond import json_response, new_call, start
from tokenyard.api.responses import stored
from tokenyard.api.responses.compaction import compaction_item
from tokenyard.api.responses.convert import items_json, parse_items
from tokenyard.api.responses.objects import new_response_id, response_usage
from tokenyard.api.responses.routes import response_plan
from tokenyard.api.responses.schemas import InputItem, MessageItem, ResponsesRequest
from tokenyard.api.schemas import Identifier, ModelName, RequestModel, reject_unknown
from tokenyard.errors import INVALID_VALUE
from tokenyard.gateway.responses import with_ids

#: The most tokens a summary may take (a few sentences).
SUMMARY_TOKENS = 128
SUMMARISE = ("You write short, faithful summaries of conversations, for whoever continues "
             "them.")
ASK = ("Summarise the conversation so far in a few sentences: keep the names, facts, "
       "numbers, decisions, tool results and open questions. Write only the summary.")


class CompactRequest(RequestModel):
    """The body of POST /v1/responses/compact (Open Responses' `CompactResponseMethod
    PublicBody`, and the SDK's prompt cache and service tier hints, which have no effect
    here)."""

    model: ModelName
    input: str | list[InputItem] | None = None
    previous_response_id: Identifier | None = None
    instructions: str | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=64)
    prompt_cache_retention: str | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        reject_unknown(data, cls.model_fields)
        return data

    @model_validator(mode="after")
    def _check(self) -> CompactRequest:
        if self.input in (None, "", []) and self.previous_response_id is None:
            raise schema_error(INVALID_VALUE, "input", "Nothing to compact: send 'input' "
                               "or 'previous_response_id'.")
        return self


def split(items: Sequence[InputItem]) -> tuple[list[InputItem], list[InputItem]]:
    """The conversation's older turns and its last one (from its last user message)."""
    users = [i for i, item in enumerate(items)
             if isinstance(item, MessageItem) and item.role == "user"]
    cut = users[-1] if users else 0
    return list(items[:cut]), list(items[cut:])


def _as_output(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Kept items as output items: with ids, messages' content as parts, a status."""
    return [item if item.get("type") == "compaction" else {"status": "completed"} | item
            for item in with_ids(items_json(items))]


async def compact(request: web.Request) -> web.Response:
    """POST /v1/responses/compact."""
    req = await read_request(request, CompactRequest)
    earlier = []
    if req.previous_response_id is not None:
        earlier = parse_items(await stored.expand_previous(request, req.previous_response_id))
    given = req.input if isinstance(req.input, list) else (
        [MessageItem(role="user", content=req.input)] if req.input else [])
    older, recent = split([*earlier, *given])
    usage = response_usage(0, 0, 0).model_dump(mode="json")
    output = _as_output(recent)
    if older:
        summary, usage = await _summarise(request, req, older)
        output.insert(0, compaction_item(summary))
    return json_response({"id": new_response_id(), "object": "response.compaction",
                          "created_at": int(time.time()), "output": output,
                          "usage": usage})


async def _summarise(request: web.Request, req: CompactRequest,
                     older: list[InputItem]) -> tuple[str, dict[str, Any]]:
    """The model's summary of the `older` items, and the usage of the turn that wrote it
    (over the context window, the oldest items are dropped until it fits)."""
    first = [{"role": "developer", "content": req.instructions}] if req.instructions else []
    turn = ResponsesRequest.model_validate({
        "model": req.model, "instructions": SUMMARISE, "store": False,
        "input": [*first, *items_json(older), {"role": "user", "content": ASK}],
        "max_output_tokens": SUMMARY_TOKENS, "truncation": "auto"})
    plan = response_plan(turn, [], _no_keep)
    run = await start(request, await new_call(request, plan.model, plan.build,
                                              **plan.options))
    try:
        body = await run.complete(plan.format(run))
    finally:
        await run.close()
    text = "".join(part.get("text", "") for item in body["output"]
                   if item.get("type") == "message" for part in item["content"])
    return text.strip(), dict(body["usage"])


async def _no_keep(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
    return None


def add_compact_route(app: web.Application) -> None:
    app.router.add_post("/v1/responses/compact", compact)
