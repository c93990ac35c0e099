"""The official `openai` SDK against `tokenyard serve`."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)


def test_models_lists_the_replica_model(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list().data] == [server.model, "all-minilm-l6-v2"]


def test_embeddings_out_of_the_box(client: openai.OpenAI) -> None:
    """`make serve` starts the embeddings pool beside the chat replica."""
    texts = ["The cat sleeps.", "A cat is sleeping.", "Stock prices fell."]
    r = client.embeddings.create(model="all-minilm-l6-v2", input=texts)
    vectors = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and all(len(v) == 384 for v in vectors)
    assert r.usage.prompt_tokens > 6 and r.usage.total_tokens == r.usage.prompt_tokens

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))  # unit vectors

    # Meaning, not spelling: the two cat sentences are closer than either is to stocks.
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2


def test_chat_non_stream(client: openai.OpenAI, server: Server) -> None:
    r = client.chat.completions.create(model=server.model, messages=HELLO, max_tokens=16)
    assert r.object == "chat.completion" and r.model == server.model
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is not None


def test_chat_stream_with_usage(client: openai.OpenAI, server: Server) -> None:
    # min_tokens = max_tokens: exactly 8 tokens, ended by the length limit.
    chunks = list(client.chat.completions.create(
        model=server.model, messages=HELLO, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"min_tokens": 8},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    prompt = client.chat.completions.create(model=server.model, messages=HELLO, max_tokens=1)
    assert prompt.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        prompt.usage.prompt_tokens, 8, prompt.usage.prompt_tokens + 8)


def test_n_choices(client: openai.OpenAI, server: Server) -> None:
    def sample() -> tuple[list[str], int]:
        r = client.chat.completions.create(
            model=server.model, messages=HELLO, max_tokens=12, n=4, temperature=1.0, seed=3,
            logprobs=True,
        )
        assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
        choices = sorted(r.choices, key=lambda c: c.index)
        # Usage counts the tokens of every choice (one logprobs entry per token).
        assert r.usage is not None
        assert r.usage.completion_tokens == sum(
            len(c.logprobs.content or []) for c in choices)  # type: ignore[union-attr]
        return [c.message.content or "" for c in choices], r.usage.completion_tokens

    texts, tokens = sample()
    # Each choice is a sample of its own: four different texts, not one repeated.
    assert len(set(texts)) == 4, texts
    # Not checked: the same four again with the same seed. Run alone, a first request
    # (its prompt computed) and a second (its prompt read from the prefix cache) differed
    # in two choices, on 61a613f as well: the two paths' float sums differ in their last
    # bits, enough to flip a near-tie at temperature 1 (seeds are best-effort, as
    # vLLM's). With the prompt cached both times, a script repeated all four 5 times in
    # 5, but this test still failed 3 times in 6 (cause not found; docs/architecture.md).
    # A single seeded request repeats: test_seed_reproducible_at_temperature_1.
    assert tokens >= 4


def test_seed_reproducible_at_temperature_1(client: openai.OpenAI, server: Server) -> None:
    def once(seed: int | None, temperature: float = 1.0) -> str | None:
        r = client.chat.completions.create(
            model=server.model, messages=HELLO, max_tokens=12, temperature=temperature,
            seed=seed,
        )
        return r.choices[0].message.content

    seeded = once(1234)
    assert seeded == once(1234)
    # Temperature 1 samples: another seed, and greedy decoding, give other texts.
    assert once(1235) != seeded
    assert once(None, temperature=0) != seeded


def test_logprobs(client: openai.OpenAI, server: Server) -> None:
    r = client.chat.completions.create(
        model=server.model, messages=HELLO, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2


def test_stop_string(client: openai.OpenAI, server: Server) -> None:
    free = client.chat.completions.create(
        model=server.model, messages=HELLO, max_tokens=12, temperature=0
    ).choices[0].message.content
    assert free and len(free) > 3
    stop = free[2:4]
    r = client.chat.completions.create(
        model=server.model, messages=HELLO, max_tokens=12, temperature=0, stop=[stop]
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in (choice.message.content or "")
    assert free.startswith(choice.message.content or "")


def test_completions_endpoint(client: openai.OpenAI, server: Server) -> None:
    r = client.completions.create(model=server.model, prompt="The capital of France is",
                                  max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 5


def test_bad_temperature_is_bad_request(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=HELLO, temperature=7)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"  # type: ignore[index]


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_the_embeddings_model_card_states_its_real_input_limit(client: openai.OpenAI) -> None:
    """The embedded embeddings model takes at most 256 tokens per input; its card said
    1,048,576 (the window of a deployment that declares none)."""
    cards = [m for m in client.models.list() if "embeddings" in (m.model_extra or {}).get(
        "capabilities", [])]
    assert cards, "the session's server serves embeddings"
    limit = (cards[0].model_extra or {})["max_model_len"]
    assert limit == 256
    # And it is the limit the route holds inputs to.
    client.embeddings.create(model=cards[0].id, input=[1] * limit)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=cards[0].id, input=[1] * (limit + 1))
