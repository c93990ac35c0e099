"""The Conversations API on a running `tokenyard serve`, through the official `openai`
SDK: a conversation is created with items, read, its metadata changed, items added,
listed, read and deleted; a response made with `conversation` sees the items before it
(its prompt holds them) and appends its input and output items; another org finds none
of it; the responses validate against the spec."""

from __future__ import annotations

import openai
import pytest

from tests.conformance.spec import Spec
from tests.e2e.conftest import Server
from tests.e2e.test_responses_store import client, other_org  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def test_conversation_items_and_responses_that_continue_it(
    client: openai.OpenAI, other_org: openai.OpenAI, server: Server,  # noqa: F811
) -> None:
    spec = Spec.load("openresponses")
    told = "My name is Ada and I like green tea."
    conv = client.conversations.create(items=[{"role": "user", "content": told}],
                                       metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert conv.metadata == {"topic": "names"}
    assert client.conversations.retrieve(conv.id).created_at == conv.created_at
    assert client.conversations.update(conv.id, metadata={"topic": "tea"}).metadata == {
        "topic": "tea"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "tea"}

    [first] = client.conversations.items.list(conv.id).data
    assert first.type == "message" and first.content[0].text == told  # type: ignore[union-attr]
    added = client.conversations.items.create(
        conv.id, items=[{"role": "assistant", "content": "Noted."}]).data
    assert [a.type for a in added] == ["message"]
    got = client.conversations.items.retrieve(added[0].id, conversation_id=conv.id)
    assert got.id == added[0].id and got.role == "assistant"  # type: ignore[union-attr]

    ask = "What is my name?"
    alone = client.responses.create(model=server.model, input=ask, max_output_tokens=2,
                                    store=False)
    raw = client.responses.with_raw_response.create(
        model=server.model, input=ask, max_output_tokens=2, conversation=conv.id)
    spec.validate(raw.http_response.json(), spec.response_schema("/responses", 200),
                  "response")
    in_conv = raw.parse()
    assert in_conv.usage is not None and alone.usage is not None
    # The earlier items are in its prompt: more input tokens than the question alone.
    assert in_conv.usage.input_tokens > alone.usage.input_tokens + 8
    items = client.conversations.items.list(conv.id, order="asc").data
    assert len(items) == 4  # told, "Noted.", the question, the reply's output item
    assert items[2].content[0].text == ask  # type: ignore[union-attr]
    assert items[3].id == in_conv.output[0].id
    again = client.responses.create(model=server.model, input=ask, max_output_tokens=2,
                                    conversation={"id": conv.id})
    assert again.usage is not None and again.usage.input_tokens > in_conv.usage.input_tokens
    assert len(client.conversations.items.list(conv.id, limit=100).data) == 6

    with pytest.raises(openai.NotFoundError):
        other_org.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        other_org.conversations.items.list(conv.id)
    with pytest.raises(openai.BadRequestError) as foreign:
        other_org.responses.create(model=server.model, input=ask, max_output_tokens=2,
                                   conversation=conv.id)
    assert foreign.value.param == "conversation"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=server.model, input=ask, max_output_tokens=2,
                                conversation=conv.id, previous_response_id=in_conv.id)

    after = client.conversations.items.delete(added[0].id, conversation_id=conv.id)
    assert after.id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added[0].id, conversation_id=conv.id)
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_bad_conversation_bodies_get_400s(client: openai.OpenAI) -> None:  # noqa: F811
    with pytest.raises(openai.BadRequestError) as bad:
        client.conversations.create(metadata={"k": "v" * 600})
    assert bad.value.param == "metadata"
    conv = client.conversations.create()
    with pytest.raises(openai.BadRequestError) as empty:
        client.conversations.items.create(conv.id, items=[])
    assert empty.value.param == "items"
    with pytest.raises(openai.BadRequestError):
        client.conversations.items.create(conv.id, items=[{"type": "nonsense"}])  # type: ignore[list-item]
    client.conversations.delete(conv.id)
