"""Stored responses on a running `tokenyard serve`, through the official `openai` SDK: what
`responses.create` stored is retrieved, its input items listed, hidden from another org,
and deleted (chains through it break). Chaining itself is tests/e2e/test_responses.py's."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.e2e.conftest import Server
from tests.e2e.test_admin_http import _call

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=0)


@pytest.fixture(scope="module")
def other_org(server: Server) -> openai.OpenAI:
    """A client with a key of an org of its own (not an admin)."""

    async def make() -> str:
        status, org = await _call(server, "POST", "/admin/v1/orgs", body={"name": "other"})
        assert status == 201, org
        status, key = await _call(server, "POST", "/admin/v1/keys",
                                  body={"org_id": org["id"], "name": "other"})
        assert status == 201, key
        return str(key["secret"])

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=asyncio.run(make()),
                         max_retries=0)


def test_a_response_is_retrieved_listed_hidden_from_other_orgs_and_deleted(
    client: openai.OpenAI, other_org: openai.OpenAI, server: Server,
) -> None:
    said = "My name is Ada. Say hi."
    first = client.responses.create(model=server.model, input=said, max_output_tokens=2)
    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.usage) == (first.id, first.output_text, first.usage)
    [item] = client.responses.input_items.list(first.id).data
    assert item.type == "message" and item.role == "user"  # type: ignore[union-attr]
    assert item.id.startswith("msg_")
    assert item.content[0].text == said  # type: ignore[union-attr]
    ask = "What is my name?"
    follow = client.responses.create(model=server.model, input=ask, max_output_tokens=2,
                                     previous_response_id=first.id)
    [own] = client.responses.input_items.list(follow.id).data  # only its own turn's items
    assert own.content[0].text == ask  # type: ignore[union-attr]

    with pytest.raises(openai.NotFoundError):
        other_org.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other_org.responses.input_items.list(first.id)
    with pytest.raises(openai.NotFoundError):
        other_org.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as foreign:
        other_org.responses.create(model=server.model, input=ask, max_output_tokens=2,
                                   previous_response_id=first.id)
    assert foreign.value.code == "previous_response_not_found"

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as broken:  # the chain through it is gone
        client.responses.create(model=server.model, input=ask, max_output_tokens=2,
                                previous_response_id=follow.id)
    assert f"'{first.id}'" in broken.value.message
