"""The official `anthropic` SDK against `tokenyard serve`."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

HELLO: list[Any] = [{"role": "user", "content": "Say hello in one short sentence."}]


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key, max_retries=0)


def test_messages_create(client: anthropic.Anthropic, server: Server) -> None:
    m = client.messages.create(model=server.model, max_tokens=12, messages=HELLO,
                               system="You are terse.")
    assert m.type == "message" and m.role == "assistant"
    assert m.content and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0
    assert 0 < m.usage.output_tokens <= 12


def test_messages_stream(client: anthropic.Anthropic, server: Server) -> None:
    with client.messages.stream(model=server.model, max_tokens=8, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.usage.output_tokens > 0


def test_count_tokens(client: anthropic.Anthropic, server: Server) -> None:
    short = client.messages.count_tokens(model=server.model, messages=HELLO)
    # (Not a system prompt: this model's template adds a default one when none is given.)
    longer = client.messages.count_tokens(
        model=server.model, messages=[{"role": "user", "content": "Say hello twice. " * 5}]
    )
    assert 0 < short.input_tokens < longer.input_tokens


def test_missing_max_tokens_is_bad_request(server: Server) -> None:
    # The SDK itself insists on max_tokens, so send the body through its raw `post`.
    client = anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", cast_to=object,
                    body={"model": server.model, "messages": HELLO})
    assert info.value.status_code == 400
    assert "max_tokens" in str(info.value)


def test_assistant_prefill_is_continued(client: anthropic.Anthropic, server: Server) -> None:
    question: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
    prefill = "The capital of France is"
    prefilled = [*question, {"role": "assistant", "content": prefill}]
    plain = client.messages.count_tokens(model=server.model, messages=question).input_tokens
    with_prefill = client.messages.count_tokens(model=server.model, messages=prefilled)
    # The prefill's own tokens, counted with no template by the text-completion route.
    raw: Any = client.post("/v1/completions", cast_to=object, body={
        "model": server.model, "prompt": prefill, "max_tokens": 1})
    # The prompt is the open assistant turn (counted in `plain`) plus the prefill: no
    # end-of-turn token after it, and no second assistant header.
    assert with_prefill.input_tokens == plain + raw["usage"]["prompt_tokens"]
    m = client.messages.create(model=server.model, max_tokens=8, messages=prefilled,
                               extra_body={"temperature": 0})
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) \
        == with_prefill.input_tokens
    # Greedy, the model finishes the sentence; in a fresh turn it starts one ("The capital
    # of France is Paris."), which joined to the prefill would read "...isThe capital".
    assert m.content[0].type == "text"
    assert (prefill + m.content[0].text).startswith("The capital of France is Paris"), m.content


def test_the_sdk_reads_the_request_id_of_an_answer_and_of_a_refusal(
    client: anthropic.Anthropic, server: Server,
) -> None:
    """Anthropic's SDK takes `_request_id` from the `request-id` header: one beside
    x-request-id, on answers and on errors alike."""
    message = client.messages.create(model=server.model, max_tokens=2,
                                     messages=[{"role": "user", "content": "Hi"}])
    assert message._request_id and message._request_id.startswith("req_")
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=server.model, max_tokens=-1,
                               messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.request_id and refused.value.request_id.startswith("req_")
