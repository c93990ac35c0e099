"""The OpenAPI 3.1 document of `GET /openapi.json`: every route a client or an operator
calls, with its request and response schemas (the pydantic models the routes validate
with), its path parameters, its security, and the errors it may answer in its dialect.

The API routes are described here by hand, from their models; the administrative routes
are read off the running router, each with its request schema (`api/admin_schemas.py`:
the body of a POST or PUT, the query of a GET), so a route added there is listed without
an edit here. The browser pages and
their static files are not API and are left out. A fuzzer (tests/chaos/test_fuzz.py)
holds the server to this document: any status or body outside it is a finding.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from tokenyard.api.admin_schemas import SCHEMAS as ADMIN_SCHEMAS
from tokenyard.api.anthropic import schemas as sa
from tokenyard.api.openai import schemas as so
from tokenyard.api.openai.embeddings import EmbeddingRequest
from tokenyard.api.openai.moderations import ModerationRequest
from tokenyard.api.requests import RequestRecordObject
from tokenyard.api.responses.compact import CompactRequest
from tokenyard.api.responses.objects import ResponseObject
from tokenyard.api.responses.schemas import ResponsesRequest

_SCHEMA_MODELS: Sequence[type[BaseModel]] = (
    so.ChatCompletionRequest, so.ChatCompletion, so.ChatCompletionChunk,
    so.CompletionRequest, so.TextCompletion, so.ModelList,
    sa.MessagesRequest, sa.AnthropicMessage, sa.CountTokensRequest, sa.CountTokensResponse,
    ResponsesRequest, ResponseObject, RequestRecordObject, EmbeddingRequest,
    ModerationRequest, CompactRequest,
)

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
#: Bodies without a model of their own: the fields every client reads.
_INLINE: dict[str, dict[str, Any]] = {
    "EmbeddingList": {"type": "object", "required": ["object", "data", "model", "usage"],
                      "properties": {"object": {"const": "list"},
                                     "data": {"type": "array"}, "model": {"type": "string"},
                                     "usage": _ANY_OBJECT}},
    "ModerationResult": {"type": "object", "required": ["id", "model", "results"],
                         "properties": {"id": {"type": "string"},
                                        "model": {"type": "string"},
                                        "results": {"type": "array"}}},
    "ResponseDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                        "properties": {"id": {"type": "string"},
                                       "object": {"const": "response.deleted"},
                                       "deleted": {"type": "boolean"}}},
    "InputItemList": {"type": "object", "required": ["object", "data", "has_more"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array"},
                                     "first_id": {"type": ["string", "null"]},
                                     "last_id": {"type": ["string", "null"]},
                                     "has_more": {"type": "boolean"}}},
    "CompactedResponse": {"type": "object",
                          "required": ["id", "object", "created_at", "output", "usage"],
                          "properties": {"id": {"type": "string"},
                                         "object": {"const": "response.compaction"},
                                         "created_at": {"type": "integer"},
                                         "output": {"type": "array"},
                                         "usage": _ANY_OBJECT}},
    # The Batch API (api/batch/): the fields SDKs read.
    **{name: {"type": "object", "required": ["id", kind],
              "properties": {"id": {"type": "string"}, kind: {"const": value}}}
       for name, kind, value in (
           ("FileObject", "object", "file"), ("FileDeleted", "object", "file"),
           ("Batch", "object", "batch"), ("MessageBatch", "type", "message_batch"),
           ("MessageBatchDeleted", "type", "message_batch_deleted"))},
    **{name: {"type": "object", "required": ["data", "has_more"],
              "properties": {"data": {"type": "array"}, "has_more": {"type": "boolean"}}}
       for name in ("FileList", "BatchList", "MessageBatchList")},
    "BatchRequest": {"type": "object",
                     "required": ["input_file_id", "endpoint", "completion_window"],
                     "properties": {"input_file_id": {"type": "string"},
                                    "endpoint": {"type": "string"},
                                    "completion_window": {"const": "24h"},
                                    "metadata": {"type": ["object", "null"]}}},
    # The Conversations API (api/responses/conversations.py).
    "Conversation": {"type": "object", "required": ["id", "object"],
                     "properties": {"id": {"type": "string"},
                                    "object": {"const": "conversation"},
                                    "created_at": {"type": "integer"},
                                    "metadata": {"type": ["object", "null"]}}},
    "ConversationDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                            "properties": {"id": {"type": "string"},
                                           "object": {"const": "conversation.deleted"},
                                           "deleted": {"type": "boolean"}}},
    "ConversationRequest": {"type": "object",
                            "properties": {"metadata": {"type": ["object", "null"]},
                                           "items": {"type": ["array", "null"]}}},
    "ConversationItemsRequest": {"type": "object", "required": ["items"],
                                 "properties": {"items": {"type": "array"}}},
    "ConversationItem": {"type": "object", "required": ["type"],
                         "properties": {"id": {"type": "string"},
                                        "type": {"type": "string"}}},
    "ConversationItemList": {"type": "object", "required": ["object", "data", "has_more"],
                             "properties": {"object": {"const": "list"},
                                            "data": {"type": "array"},
                                            "has_more": {"type": "boolean"}}},
    "FileContent": {"type": "string", "description": "the file's bytes"},
    "BatchResults": {"type": "string", "description": "JSON lines, one per request"},
    "MessageBatchRequest": {"type": "object", "required": ["requests"],
                            "properties": {"requests": {"type": "array"}}},
    # The two dialects' error bodies (api/errors.py renders them).
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"},
                                 "message": {"type": "string"}}}}},
}

#: (path, method, request schema or None, response schema, success status); the API.
_API_ROUTES: Sequence[tuple[str, str, str | None, str, str]] = (
    ("/v1/chat/completions", "post", "ChatCompletionRequest", "ChatCompletion", "200"),
    ("/v1/completions", "post", "CompletionRequest", "TextCompletion", "200"),
    ("/v1/models", "get", None, "ModelList", "200"),
    ("/v1/models/{model_id}", "get", None, "ModelCard", "200"),
    ("/v1/messages", "post", "MessagesRequest", "AnthropicMessage", "200"),
    ("/v1/messages/count_tokens", "post", "CountTokensRequest", "CountTokensResponse", "200"),
    ("/v1/embeddings", "post", "EmbeddingRequest", "EmbeddingList", "200"),
    ("/v1/moderations", "post", "ModerationRequest", "ModerationResult", "200"),
    ("/v1/responses", "post", "ResponsesRequest", "ResponseObject", "200"),
    ("/v1/responses/{response_id}", "get", None, "ResponseObject", "200"),
    ("/v1/responses/{response_id}", "delete", None, "ResponseDeleted", "200"),
    ("/v1/responses/{response_id}/input_items", "get", None, "InputItemList", "200"),
    ("/v1/responses/{response_id}/cancel", "post", None, "ResponseObject", "200"),
    ("/v1/responses/compact", "post", "CompactRequest", "CompactedResponse", "200"),
    ("/v1/conversations", "post", "ConversationRequest", "Conversation", "200"),
    ("/v1/conversations/{conversation_id}", "get", None, "Conversation", "200"),
    ("/v1/conversations/{conversation_id}", "post", "ConversationRequest", "Conversation",
     "200"),
    ("/v1/conversations/{conversation_id}", "delete", None, "ConversationDeleted", "200"),
    ("/v1/conversations/{conversation_id}/items", "get", None, "ConversationItemList", "200"),
    ("/v1/conversations/{conversation_id}/items", "post", "ConversationItemsRequest",
     "ConversationItemList", "200"),
    ("/v1/conversations/{conversation_id}/items/{item_id}", "get", None, "ConversationItem",
     "200"),
    ("/v1/conversations/{conversation_id}/items/{item_id}", "delete", None, "Conversation",
     "200"),
    ("/v1/requests/{request_id}", "get", None, "RequestRecordObject", "200"),
    # The Batch API; an upload is multipart, a file's content and batch results are bytes.
    ("/v1/files", "post", None, "FileObject", "200"),
    ("/v1/files", "get", None, "FileList", "200"),
    ("/v1/files/{file_id}", "get", None, "FileObject", "200"),
    ("/v1/files/{file_id}", "delete", None, "FileDeleted", "200"),
    ("/v1/files/{file_id}/content", "get", None, "FileContent", "200"),
    ("/v1/batches", "post", "BatchRequest", "Batch", "200"),
    ("/v1/batches", "get", None, "BatchList", "200"),
    ("/v1/batches/{batch_id}", "get", None, "Batch", "200"),
    ("/v1/batches/{batch_id}/cancel", "post", None, "Batch", "200"),
    ("/v1/messages/batches", "post", "MessageBatchRequest", "MessageBatch", "200"),
    ("/v1/messages/batches", "get", None, "MessageBatchList", "200"),
    ("/v1/messages/batches/{batch_id}", "get", None, "MessageBatch", "200"),
    ("/v1/messages/batches/{batch_id}", "delete", None, "MessageBatchDeleted", "200"),
    ("/v1/messages/batches/{batch_id}/cancel", "post", None, "MessageBatch", "200"),
    ("/v1/messages/batches/{batch_id}/results", "get", None, "BatchResults", "200"),
)

#: Routes anyone may call, with what they answer (no key, no security).
_PUBLIC_ROUTES: Sequence[tuple[str, str, str]] = (
    ("/healthz", "200", "application/json"),
    ("/readyz", "200", "application/json"),
    ("/metrics", "200", "text/plain"),
    ("/openapi.json", "200", "application/json"),
)

_SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer"},
    "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}
_PARAM = re.compile(r"\{(\w+)\}")


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _operation(path: str, ok: str, ok_schema: dict[str, Any],
               request: dict[str, Any] | None) -> dict[str, Any]:
    """One keyed operation: its success, its errors in the route's dialect (4xx, and the
    two refusals of an overloaded server: 503, and Anthropic's 529), its security."""
    anthropic = path.startswith("/v1/messages")
    error = _ref("AnthropicError" if anthropic else "OpenAIError")
    responses = {ok: _json(ok_schema, "OK"), "4XX": _json(error, "Refused"),
                 "503": _json(error, "Overloaded or unavailable")}
    if anthropic:
        responses["529"] = _json(error, "Overloaded")
    op: dict[str, Any] = {"responses": responses,
                          "security": [{"bearer": []}, *([{"x-api-key": []}] if anthropic
                                                         else [])]}
    params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
              for name in _PARAM.findall(path)]
    if params:
        op["parameters"] = params
    if request is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": request}}}
    return op


def _add_schema(schemas: dict[str, Any], model: type[BaseModel], name: str) -> None:
    """`model`'s JSON schema as `name` among `schemas`; nested models move up beside it,
    where the $refs point."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[name] = schema


@lru_cache(maxsize=4)
def openapi_document(admin_routes: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """The document: the API and public routes, plus `admin_routes` ((method, path) of the
    router's /admin/ routes) as free-form keyed operations. Cached: callers must not
    change it."""
    schemas: dict[str, Any] = {}
    for model in _SCHEMA_MODELS:
        _add_schema(schemas, model, model.__name__)
    schemas.update(_INLINE)
    paths: dict[str, dict[str, Any]] = {}
    for path, method, request_name, response_name, ok in _API_ROUTES:
        paths.setdefault(path, {})[method] = _operation(
            path, ok, _ref(response_name), _ref(request_name) if request_name else None)
    # A background response's stream, resumed after a sequence number (api/responses/
    # background.py): the same route, as server-sent events.
    retrieve = paths["/v1/responses/{response_id}"]["get"]
    retrieve["parameters"].extend(
        {"name": name, "in": "query", "required": False, "schema": {"type": kind}}
        for name, kind in (("stream", "boolean"), ("starting_after", "integer")))
    retrieve["responses"]["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    for path, ok, content_type in _PUBLIC_ROUTES:
        paths[path] = {"get": {"security": [], "responses": {
            ok: {"description": "OK", "content": {content_type: {"schema": {}}}}}}}
    for method, path in sorted(admin_routes):
        admin_model = ADMIN_SCHEMAS.get((method.upper(), path))
        body = method.lower() in ("post", "put", "patch")
        name = f"Admin{admin_model.__name__}" if admin_model is not None else ""
        if admin_model is not None:
            _add_schema(schemas, admin_model, name)
        op = _operation(path, "2XX", _ANY_OBJECT, _ref(name) if body and name else None)
        if body and admin_model is not None:
            op["requestBody"]["required"] = False
        elif admin_model is not None:
            op.setdefault("parameters", []).extend(
                {"name": field, "in": "query", "required": False,
                 "schema": {"type": "string"}} for field in admin_model.model_fields)
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenyard", "version": "0.1"},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": _SECURITY_SCHEMES},
    }
