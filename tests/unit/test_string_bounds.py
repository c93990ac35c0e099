"""Every string a request body may carry has a size bound.

Either the field bounds it itself (`max_length`, or a pattern anchored at both ends that
matches at most so many characters), or it is listed below with what bounds it instead: for
what the model reads, the body cap and then the context window; for the few others, the
check that refuses them. Identifiers the model never reads (the model's name, `user`,
`metadata`, cache keys, stored ids) and stop strings carry bounds of their own, the specs'
where the specs give one (/work/shared/specs). A new string field of any request schema
fails here until it is one or the other.
"""

from __future__ import annotations

import inspect
import json
import types
from re import _parser as sre_parse  # only to read a pattern's width
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
from annotated_types import MaxLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tokenyard.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from tokenyard.api.errors import parse_body
from tokenyard.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.api.schemas import MAX_ID_LENGTH, MAX_MODEL_LENGTH
from tokenyard.errors import APIError
from tokenyard.text.stop import MAX_STOP_LENGTH

ROOTS: list[type[BaseModel]] = [
    ChatCompletionRequest, CompletionRequest, MessagesRequest, CountTokensRequest,
    ResponsesRequest,
]

CONTENT = "read by the model: the body cap, then the context window once tokenized"
SCHEMA = ("a JSON schema's text, rendered into the prompt or compiled to a grammar: the body "
          "cap, then the context window")
GRAMMAR = "a guided-decoding spec compiled by the replica's grammar backend: the body cap"
IMAGE = ("an image URL or data URI: the body cap, then the image fetch's byte cap and "
         "api.images' pixel limits")
HINT = "a JSON object accepted without effect, never read: the body cap"
REFUSED = "refused with a 400 whenever it is set (or, `suffix`, not empty): never read or kept"
CHOSEN = "must equal the name of one of the request's `tools` (pattern-bounded), else a 400"

#: String fields bounded by something other than their own declared length, and why.
#: Keys: the declaring model and field, `{key}` for the keys of a dict field.
BOUNDED_ELSEWHERE: dict[str, str] = {
    # A compaction item's summary, encoded: it must decode to a summary this server wrote
    # (else a 400), and is read by the model as a system message.
    "CompactionItem.encrypted_content": CONTENT,
    # OpenAI chat and completions
    "ChatMessage.content": CONTENT,
    "ChatMessage.name": CONTENT,
    "ChatMessage.tool_call_id": CONTENT,
    "TextContentPart.text": CONTENT,
    "ImageURL.url": IMAGE,
    "ToolCallParam.id": CONTENT,
    "ToolCallFunction.name": CONTENT,
    "ToolCallFunction.arguments": CONTENT,
    "FunctionDefinition.description": CONTENT,
    "FunctionDefinition.parameters{key}": SCHEMA,
    "FunctionName.name": CHOSEN,
    "JSONSchemaFormat.description": SCHEMA,
    "JSONSchemaFormat.schema{key}": SCHEMA,
    "SamplingFields.guided_json": GRAMMAR,
    "SamplingFields.guided_json{key}": GRAMMAR,
    "SamplingFields.guided_regex": GRAMMAR,
    "SamplingFields.guided_grammar": GRAMMAR,
    "SamplingFields.guided_choice": GRAMMAR,
    "SamplingFields.logit_bias{key}": "token ids: api.openai.convert refuses a key that is "
                                      "not 1 to 10 digits",
    "ChatHints.prediction{key}": HINT,
    "ChatHints.prompt_cache_options{key}": HINT,
    "PlatformFields.metadata": "PlatformFields._check_metadata: OpenAI's 16 pairs, keys of "
                               "at most 64 characters, values of at most 512",
    "PlatformFields.metadata{key}": "PlatformFields._check_metadata, as for the values",
    "CompletionRequest.prompt": CONTENT,
    "CompletionRequest.suffix": REFUSED,
    # Anthropic messages
    "MessageParam.content": CONTENT,
    "TextBlockParam.text": CONTENT,
    "ImageSource.data": IMAGE,
    "ImageSource.url": IMAGE,
    "ToolUseBlockParam.id": CONTENT,
    "ToolUseBlockParam.name": CONTENT,
    "ToolUseBlockParam.input{key}": CONTENT,
    "ToolResultBlockParam.tool_use_id": CONTENT,
    "ToolResultBlockParam.content": CONTENT,
    "_Conversation.system": CONTENT,
    "ToolParam.description": CONTENT,
    "ToolParam.input_schema{key}": SCHEMA,
    "ToolChoiceParam.name": CHOSEN,
    "JSONOutputFormat.schema{key}": SCHEMA,
    "GenerationOptions.diagnostics{key}": HINT,
    # Responses
    "ResponsesRequest.input": CONTENT,
    "ResponsesRequest.instructions": CONTENT,
    "MessageItem.content": CONTENT,
    "TextPart.text": CONTENT,
    "TextPart.refusal": CONTENT,
    "ImageInputPart.image_url": IMAGE,
    "ImageInputPart.file_id": REFUSED,
    "FunctionCallItem.call_id": CONTENT,
    "FunctionCallItem.name": CONTENT,
    "FunctionCallItem.arguments": CONTENT,
    "FunctionCallOutputItem.call_id": CONTENT,
    "FunctionCallOutputItem.output": CONTENT,
    "McpApprovalRequestItem.arguments": CONTENT,
    "McpCallItem.arguments": CONTENT,
    "McpCallItem.output": CONTENT,
    "McpListToolsItem.error": "an earlier response's listing error, read back: never read",
    "McpListToolsItem.tools{key}": SCHEMA,
    "FunctionTool.description": CONTENT,
    "FunctionTool.parameters{key}": SCHEMA,
    "FunctionChoice.name": CHOSEN,
    "TextFormat.description": SCHEMA,
    "TextFormat.schema{key}": SCHEMA,
}


def _declaring(model: type[BaseModel], name: str) -> str:
    """The class whose body declares field `name` (a base's, for an inherited field)."""
    for base in reversed(model.__mro__):
        if name in inspect.get_annotations(base):
            return base.__name__
    return model.__name__


def _pattern_width(pattern: str) -> int | None:
    """The most characters a value can have if it must match `pattern`, or None when the
    pattern does not bound it (not anchored at both ends, or an unbounded repeat)."""
    if not (pattern.startswith("^") and pattern.endswith("$")):
        return None
    widest = sre_parse.parse(pattern).getwidth()[1]
    return widest if widest < sre_parse.MAXREPEAT else None


def _bound(metadata: list[Any]) -> int | None:
    """The length bound the constraints in `metadata` put on a string, if any."""
    for item in metadata:
        if isinstance(item, FieldInfo):
            found = _bound(list(item.metadata))
            if found is not None:
                return found
        if isinstance(item, MaxLen):
            return item.max_length
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str) and _pattern_width(pattern) is not None:
            return _pattern_width(pattern)
    return None


def _walk(tp: Any, where: str, metadata: list[Any], out: dict[str, int | None],
          seen: set[type]) -> None:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *more = get_args(tp)
        _walk(base, where, [*metadata, *more], out, seen)
    elif tp is str:
        bound = _bound(metadata)
        # A field with several string members is bounded only if every member is.
        out[where] = bound if out.get(where, bound) is not None else None
    elif origin in (Union, types.UnionType):
        for member in get_args(tp):
            _walk(member, where, metadata, out, seen)
    elif origin in (list, tuple):
        for item in get_args(tp):
            _walk(item, where, [], out, seen)
    elif origin is dict:
        key, value = get_args(tp)
        _walk(key, where + "{key}", [], out, seen)
        _walk(value, where, [], out, seen)
    elif isinstance(tp, type) and issubclass(tp, BaseModel) and tp not in seen:
        seen.add(tp)
        for name, field in tp.model_fields.items():
            _walk(field.annotation, f"{_declaring(tp, name)}.{field.alias or name}",
                  list(field.metadata), out, seen)


def string_fields() -> dict[str, int | None]:
    """Every string field reachable from a request schema: its bound, or None."""
    out: dict[str, int | None] = {}
    seen: set[type] = set()
    for root in ROOTS:
        _walk(root, root.__name__, [], out, seen)
    return out


def test_every_string_field_is_bounded_or_listed_with_a_reason() -> None:
    fields = string_fields()
    unbounded = sorted(name for name, bound in fields.items()
                       if bound is None and name not in BOUNDED_ELSEWHERE)
    assert not unbounded, (
        f"string fields without a size bound: {unbounded}; give each a max_length (the "
        "spec's where it has one) or list it in BOUNDED_ELSEWHERE with what bounds it")
    stale = sorted(set(BOUNDED_ELSEWHERE) - {n for n, b in fields.items() if b is None})
    assert not stale, f"listed but now bounded by the schema, or gone: {stale}"


def test_identifiers_carry_the_specs_bounds() -> None:
    fields = string_fields()
    expected = {
        # OpenAI / Open Responses
        "PlatformFields.user": MAX_ID_LENGTH,
        "PlatformFields.prompt_cache_key": 64,
        "PlatformFields.safety_identifier": 64,
        "ChatCompletionRequest.model": MAX_MODEL_LENGTH,
        "CompletionRequest.model": MAX_MODEL_LENGTH,
        "ResponsesRequest.model": MAX_MODEL_LENGTH,
        "ResponsesRequest.previous_response_id": MAX_ID_LENGTH,
        "SamplingFields.stop": MAX_STOP_LENGTH,
        "FunctionDefinition.name": 64,
        "JSONSchemaFormat.name": 64,
        "FunctionTool.name": 64,
        "TextFormat.name": 64,
        # Anthropic
        "Metadata.user_id": 512,
        "_Conversation.model": MAX_MODEL_LENGTH,
        "MessagesRequest.stop_sequences": MAX_STOP_LENGTH,
        "ToolParam.name": 64,
    }
    assert {name: fields.get(name) for name in expected} == expected


# ---------------------------------------------------------------------------- the 400s

def _error(model: type[BaseModel], body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse_body(model, json.dumps(body).encode())
    return info.value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi"}


@pytest.mark.parametrize(("model", "body", "param"), [
    (ChatCompletionRequest, {**CHAT, "stop": "z" * (MAX_STOP_LENGTH + 1)}, "stop"),
    (ChatCompletionRequest, {**CHAT, "stop": ["a", "z" * (MAX_STOP_LENGTH + 1)]}, "stop.1"),
    (CompletionRequest, {"model": "m", "prompt": "x", "stop": ["z" * 20_000]}, "stop.0"),
    (MessagesRequest, {**MESSAGES, "stop_sequences": ["z" * (MAX_STOP_LENGTH + 1)]},
     "stop_sequences.0"),
    (ChatCompletionRequest, {**CHAT, "model": "m" * (MAX_MODEL_LENGTH + 1)}, "model"),
    (MessagesRequest, {**MESSAGES, "model": "m" * (MAX_MODEL_LENGTH + 1)}, "model"),
    (ChatCompletionRequest, {**CHAT, "user": "u" * (MAX_ID_LENGTH + 1)}, "user"),
    (ChatCompletionRequest, {**CHAT, "metadata": {"k": "v" * 513}}, "metadata"),
    (ChatCompletionRequest, {**CHAT, "metadata": {"k" * 65: "v"}}, "metadata"),
    (CompletionRequest, {"model": "m", "prompt": "x",
                         "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    (ChatCompletionRequest, {**CHAT, "prompt_cache_key": "k" * 65}, "prompt_cache_key"),
    (ResponsesRequest, {**RESPONSES, "safety_identifier": "s" * 65}, "safety_identifier"),
    (ResponsesRequest, {**RESPONSES, "previous_response_id": "r" * (MAX_ID_LENGTH + 1)},
     "previous_response_id"),
    (MessagesRequest, {**MESSAGES, "metadata": {"user_id": "u" * 513}}, "metadata.user_id"),
    (MessagesRequest, {**MESSAGES, "workspace_id": "w" * (MAX_ID_LENGTH + 1)},
     "workspace_id"),
])
def test_a_string_over_its_bound_is_a_400_naming_it(
        model: type[BaseModel], body: dict[str, Any], param: str) -> None:
    err = _error(model, body)
    assert (err.status, err.param, err.code) == (400, param, "invalid_value")
    assert param in err.message


@pytest.mark.parametrize(("model", "body"), [
    (ChatCompletionRequest, {**CHAT, "stop": "z" * MAX_STOP_LENGTH}),
    (ChatCompletionRequest, {**CHAT, "stop": ["z" * MAX_STOP_LENGTH] * 4, "user": "u" * 512,
                             "metadata": {f"{i:064d}": "v" * 512 for i in range(16)}}),
    (MessagesRequest, {**MESSAGES, "stop_sequences": ["z" * MAX_STOP_LENGTH],
                       "metadata": {"user_id": "u" * 512}}),
])
def test_a_string_at_its_bound_is_accepted(model: type[BaseModel], body: dict[str, Any]) -> None:
    parse_body(model, json.dumps(body).encode())


def test_the_pattern_width_reader_tells_bounded_from_unbounded() -> None:
    assert _pattern_width(r"^[a-zA-Z0-9_-]{1,64}$") == 64
    assert _pattern_width(r"^[A-Za-z0-9_-]+$") is None
    assert _pattern_width(r"[a-z]{1,3}") is None  # unanchored: "abcd" contains a match
