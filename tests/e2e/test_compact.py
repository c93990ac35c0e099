"""POST /v1/responses/compact on a running `tokenyard serve`, through the official
`openai` SDK: a conversation of three turns comes back as a compaction item (the model's
summary of the first two) and the last turn as it was; the body validates against Open
Responses' `CompactResource`; sending the output back continues the conversation; the
summary's model turn is billed under the key; a compaction this server did not write is
a 400 naming it; another org cannot compact from a response it cannot see."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import openai
import pytest

from tests.conformance.spec import Spec
from tests.e2e.conftest import Server
from tests.e2e.test_responses_store import client, other_org  # noqa: F401 (fixtures)
from tests.integration.test_workers import poll

pytestmark = pytest.mark.slow

TURNS = [
    {"role": "user", "content": "My name is Ada and I live in Lisbon."},
    {"role": "assistant", "content": "Nice to meet you, Ada from Lisbon."},
    {"role": "user", "content": "I keep three cats named Io, Europa and Callisto."},
    {"role": "assistant", "content": "Three cats named after moons of Jupiter!"},
    {"role": "user", "content": "What should I cook tonight?"},
]


def test_compact_summarises_older_turns_and_keeps_the_last(
        client: openai.OpenAI, server: Server) -> None:  # noqa: F811
    raw = client.responses.with_raw_response.compact(model=server.model, input=TURNS)
    body = raw.http_response.json()
    Spec.load("openresponses").validate(body, "CompactResource", "compact")
    compacted = raw.parse()
    assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
    first, last = compacted.output
    assert first.type == "compaction" and first.encrypted_content
    assert last.type == "message" and last.content[0].text == TURNS[-1]["content"]  # type: ignore[union-attr]
    assert compacted.usage.input_tokens > 0 and compacted.usage.output_tokens > 0

    again = client.responses.create(
        model=server.model, max_output_tokens=2,
        input=[item.model_dump(exclude_none=True) for item in compacted.output])
    assert again.status in ("completed", "incomplete") and again.usage is not None

    # The summary's turn is billed under the key, under the compact request's id.
    request_id = raw.http_response.headers["x-request-id"]
    assert server.state_dir is not None

    def rows() -> list[tuple[int]]:
        with sqlite3.connect(Path(server.state_dir or "") / "tokenyard.db") as conn:
            return conn.execute("SELECT output_tokens FROM usage_ledger WHERE request_id = ?",
                                (request_id,)).fetchall()

    assert poll(rows, bool, 30, "its ledger row") == [(compacted.usage.output_tokens,)]


def test_a_single_turn_comes_back_as_it_is_and_bad_input_is_a_400(
        client: openai.OpenAI, other_org: openai.OpenAI, server: Server) -> None:  # noqa: F811
    alone = client.responses.compact(model=server.model, input="Just one question?")
    assert [i.type for i in alone.output] == ["message"]
    assert alone.usage.total_tokens == 0
    with pytest.raises(openai.BadRequestError) as forged:
        client.responses.create(model=server.model, input=[
            {"type": "compaction", "encrypted_content": "not ours"},
            {"role": "user", "content": "Hi"}])
    assert forged.value.param == "input.0.encrypted_content"
    first = client.responses.create(model=server.model, input=TURNS, max_output_tokens=2)
    chained = client.responses.compact(model=server.model, previous_response_id=first.id,
                                       input="And dessert?")
    assert chained.output[0].type == "compaction"
    with pytest.raises(openai.BadRequestError) as foreign:
        other_org.responses.compact(model=server.model, previous_response_id=first.id)
    assert foreign.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.compact(model="no-such-model", input=TURNS)
