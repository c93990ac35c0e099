"""Structured output through the official `openai` SDK against `tokenyard serve`: the
output of `response_format` always parses and validates, streamed or not, alone or
batched with unconstrained requests; invalid schemas are 400s naming the field."""

from __future__ import annotations

import datetime
import json
import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

ASK = "Reply with a JSON object for a made-up record."

# Value shapes; each bounded so that a sample at temperature 1 ends well within max_tokens.
FIELDS: list[dict[str, Any]] = [
    {"type": "string", "maxLength": 12},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "date-time"},
    {"type": "integer", "minimum": 0, "maximum": 100},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "number", "minimum": 0, "maximum": 10},
    {"type": "boolean"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
               {"type": "string", "maxLength": 6}]},
    {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "tag": {"type": "string", "maxLength": 8}},
     "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {
        "type": "array", "maxItems": 2,
        "items": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
]


def make_schemas(count: int, seed: int = 11) -> list[dict[str, Any]]:
    """`count` object schemas of 1 to 4 properties drawn from FIELDS, some optional."""
    rng = random.Random(seed)
    schemas = []
    for i in range(count):
        chosen = [FIELDS[i % len(FIELDS)], *rng.sample(FIELDS, rng.randint(0, 3))]
        names = [f"f{j}" for j in range(len(chosen))]
        required = [n for n in names if rng.random() < 0.7] or names[:1]
        schemas.append({"type": "object", "properties": dict(zip(names, chosen, strict=True)),
                        "required": required, "additionalProperties": False})
    return schemas


def check(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0,
                         timeout=600)


class Owner(pydantic.BaseModel):
    id: uuid.UUID
    since: datetime.date


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=30)
    vaccinated: bool
    owners: list[Owner] = pydantic.Field(max_length=2)


def test_parse_returns_the_pydantic_object(client: openai.OpenAI, server: Server) -> None:
    completion = client.chat.completions.parse(
        model=server.model, response_format=Pet, temperature=1.0, max_tokens=300,
        messages=[{"role": "user", "content": "Describe a pet as JSON."}],
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet)
    assert Pet.model_validate_json(message.content or "") == message.parsed
    check(message.content or "", Pet.model_json_schema())


def test_json_object_mode_gives_a_json_object(client: openai.OpenAI, server: Server) -> None:
    completion = client.chat.completions.create(
        model=server.model, response_format={"type": "json_object"}, temperature=0.0,
        max_tokens=200, messages=[{"role": "user", "content": "Give me a small JSON object."}],
    )
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # an open object may run to the limit: still a valid JSON prefix of an object
        assert (choice.message.content or "").startswith("{")


def _one(client: openai.OpenAI, model: str, schema: dict[str, Any] | None,
         stream: bool, temperature: float = 1.0) -> tuple[str, str | None]:
    kwargs: dict[str, Any] = {
        "model": model, "temperature": temperature, "max_tokens": 320,
        "messages": [{"role": "user", "content": ASK if schema else "Tell me a short story."}],
    }
    if schema is not None:
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "record", "schema": schema, "strict": True}}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, reason = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            reason = c.finish_reason or reason
    return "".join(text), reason


def test_fifty_schemas_at_temperature_1_all_parse_and_validate_batched_with_free_text(
    client: openai.OpenAI, server: Server,
) -> None:
    schemas = make_schemas(50)
    jobs: list[tuple[dict[str, Any] | None, bool]] = [
        (schema, i % 2 == 1) for i, schema in enumerate(schemas)
    ] + [(None, i % 2 == 0) for i in range(6)]  # unconstrained neighbours in the same batches
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _one(client, server.model, *job), jobs))
    failures = []
    for (schema, stream), (text, reason) in zip(jobs, results, strict=True):
        if schema is None:
            assert reason in ("stop", "length")
            continue
        try:
            assert reason == "stop", f"finish_reason {reason}"
            check(text, schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((stream, text, str(exc)[:200]))
    assert not failures, f"{len(failures)} of {len(schemas)} failed: {failures}"


def test_seeded_constrained_stream_matches_non_stream(client: openai.OpenAI,
                                                      server: Server) -> None:
    schema = make_schemas(1, seed=5)[0]
    kwargs: dict[str, Any] = {
        "model": server.model, "temperature": 1.0, "seed": 77, "max_tokens": 320,
        "messages": [{"role": "user", "content": ASK}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "r", "schema": schema}},
    }
    plain = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == plain
    check(plain, schema)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "email", "maxLength": 9}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_invalid_grammars_are_400_naming_the_field(
    client: openai.OpenAI, server: Server, body: dict[str, Any], param: str,
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
            extra_body=body,
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert (error.get("param") or "").startswith(param), error


def test_email_format(client: openai.OpenAI, server: Server) -> None:
    """An email cannot be bounded in length along with its format (XGrammar enforces the
    format alone, so a length with it is refused): sampled greedily here."""
    schema = {"type": "object", "properties": {"email": {"type": "string", "format": "email"}},
              "required": ["email"], "additionalProperties": False}
    text, reason = _one(client, server.model, schema, stream=False, temperature=0.0)
    assert reason == "stop"
    check(text, schema)


def test_vllm_guided_choice(client: openai.OpenAI, server: Server) -> None:
    completion = client.chat.completions.create(
        model=server.model, temperature=1.0, max_tokens=20,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        extra_body={"guided_choice": ["yes", "no", "maybe so"]},
    )
    assert completion.choices[0].message.content in ("yes", "no", "maybe so")
