"""What every client test shares: where the session's server is, the one tool and the one
structured-output shape every client asks for, and the checks each cell makes.

The model is SmolLM2-135M: the checks are on the protocol (a call came back with the
tool's name and arguments that validate, the client parsed the structured output into its
type), never on the model's wisdom. Calls are forced where the client lets us force them
(tool_choice required / any), and kept short (max_tokens ≤ 16, ≤ 48 for structured output
and tool calls), at temperature 0.
"""

from __future__ import annotations

import importlib
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import jsonschema
import pydantic
import pytest

from tests.conftest import require_service
from tests.e2e.conftest import Server

# Clients that look for a price list or an encoding online at import or first use must
# find their bundled copy: no network is reachable from the tests.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

#: The embeddings model `make serve` starts beside the chat replica.
EMBEDDING_MODEL = "all-minilm-l6-v2"
EMBEDDING_SIZE = 384

HELLO = "Say hello in one short sentence."
#: A question SmolLM2 answers well within 16 tokens at temperature 0, for clients that
#: take a reply cut by max_tokens for an error (openai-agents on the Responses API).
ASK_SHORT = "What is 2+2? Answer with a number."
ASK_WEATHER = "What is the weather in Paris?"
ASK_CITY = "Describe Paris as a JSON object."
MAX_TOKENS = 16
MAX_STRUCTURED = 48  # a forced call or a JSON object needs more than a greeting

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_DESCRIPTION = "The current weather in a city."
#: What every client's tool answers: the test checks the model was sent it, not its use.
WEATHER_RESULT = "18 degrees and sunny"


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    return f"{WEATHER_RESULT} in {city}"


# Real types, not this module's postponed strings: clients that build a schema from the
# signature (LlamaIndex, pydantic-ai) resolve annotations in their own namespace.
get_weather.__annotations__ = typing.get_type_hints(get_weather)


class City(pydantic.BaseModel):
    """The structured-output shape: small and bounded, so 48 tokens always close it.
    Bounded by an enum, which every client passes on: the Anthropic SDKs move numeric and
    length bounds into the description (Anthropic's API takes none), and SmolLM2 then
    writes a 30-digit population."""

    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=16)
    size: Literal["village", "town", "city"]


def client_library(module: str) -> ModuleType:
    """`module`, imported at a test module's top. Missing, the test module skips with the
    reason, or fails where CI is set (`require_service`): the `clients` extra and the
    Makefile install every client library."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        problem = (f"it does not import ({exc}): run `make venv`, which installs the "
                   "`clients` extra")
    try:
        require_service(module, False, problem)
    except pytest.skip.Exception as skipped:
        # At a module's top a skip must say it skips the whole module.
        raise pytest.skip.Exception(str(skipped.msg), allow_module_level=True) from None
    raise AssertionError("not reached: require_service skips or fails")


@dataclass(frozen=True)
class Target:
    """The server as a client library wants it: one base URL per dialect, the key, the
    chat model and the embeddings model."""

    server: Server
    api_key: str

    @property
    def openai_url(self) -> str:
        """Base URL of the OpenAI dialect (clients append /chat/completions etc.)."""
        return self.server.base_url + "/v1"

    @property
    def anthropic_url(self) -> str:
        """Base URL of the Anthropic dialect (clients append /v1/messages)."""
        return self.server.base_url

    @property
    def model(self) -> str:
        return self.server.model


@pytest.fixture(scope="session")
def target(server: Server) -> Target:
    return Target(server, server.api_key or "none")


def check_text(text: object, what: str) -> None:
    """A reply is a non-empty string."""
    assert isinstance(text, str) and text.strip(), f"{what}: no text came back, got {text!r}"


def check_usage(prompt: int | None, completion: int | None, cached: object, what: str) -> None:
    """Token counts the client surfaced: both positive, and the cached count's field
    present (its value is whatever the prefix cache held)."""
    assert prompt and prompt > 0, f"{what}: prompt/input tokens missing or 0 ({prompt!r})"
    assert completion and completion > 0, f"{what}: completion tokens missing or 0 ({completion!r})"
    assert isinstance(cached, int) and cached >= 0, (
        f"{what}: cached-tokens field missing ({cached!r})")


def check_weather_args(args: object, what: str) -> None:
    """A forced call's arguments: a dict valid against the tool's schema."""
    assert isinstance(args, dict), f"{what}: tool arguments are not an object: {args!r}"
    try:
        jsonschema.validate(args, WEATHER_SCHEMA)
    except jsonschema.ValidationError as exc:
        raise AssertionError(f"{what}: tool arguments {args!r} break the schema: "
                             f"{exc.message}") from exc


def check_city(value: object, what: str) -> None:
    """The client's structured-output call gave back a City."""
    assert isinstance(value, City), f"{what}: expected a City, got {value!r}"


def check_embeddings(vectors: list[list[float]], count: int, what: str) -> None:
    assert len(vectors) == count, f"{what}: {len(vectors)} vectors for {count} inputs"
    sizes = {len(v) for v in vectors}
    assert sizes == {EMBEDDING_SIZE}, f"{what}: vector sizes {sizes}, want {EMBEDDING_SIZE}"


#: One cell of the matrix: a function of the target.
Cell = Callable[[Target], None]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test `test_<client>(cell, target)` runs every cell of its module's
    `<CLIENT>_CELLS` table, the cell's name as its id: `test_litellm[stream]`. (A call a
    client lacks is left out of its table, and its module says why.)"""
    if "cell" not in metafunc.fixturenames:
        return
    client = metafunc.function.__name__.removeprefix("test_")
    table: dict[str, Cell] = getattr(metafunc.module, client.upper() + "_CELLS")
    metafunc.parametrize("cell", list(table.values()), ids=list(table))
