"""`tokenyard serve --stream-interval-ms` through the public route, with the openai SDK: a
replica whose steps are shorter than the interval hands its tokens over together and the
stream carries them in fewer, larger chunks — every token there, in order, the first one
not held back. The null model (`engine/null_model.py`) makes steps far shorter than any
interval here."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from tokenyard.bench.children import Child, start_tokenyard

TOKENS = 64


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Child, str]]:
    child, key = start_tokenyard(
        None, auth=True, env_extra={"TOKENYARD_NULL_MODEL": "on"},
        extra=["--max-num-seqs", "4", "--kv-cache-gib", "0.05", "--threads", "1",
               "--stream-interval-ms", "60000"])
    assert key is not None
    try:
        yield child, key
    finally:
        child.stop()


def _stream(server: tuple[Child, str]) -> tuple[list[str], int, float, float]:
    child, key = server
    client = openai.OpenAI(base_url=child.url + "/v1", api_key=key)
    model = client.models.list().data[0].id
    started = time.monotonic()
    first_at = 0.0
    pieces: list[str] = []
    completion_tokens = 0
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "count"}], stream=True,
            max_tokens=TOKENS, temperature=0.0, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            if not pieces:
                first_at = time.monotonic() - started
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return pieces, completion_tokens, first_at, time.monotonic() - started


def test_short_steps_reach_the_client_together_and_whole(
        server: tuple[Child, str]) -> None:
    pieces, tokens, first_at, total = _stream(server)
    assert tokens == TOKENS
    # The first token goes at once; the rest were held for the interval (a minute) until
    # the request finished, which hands everything over: two content chunks in all (a
    # reader behind them could only join them further).
    assert 1 <= len(pieces) <= 2, pieces
    assert first_at < 30 and total < 30  # neither waited for the minute
    # Non-streamed, the same greedy request gives the same text.
    child, key = server
    client = openai.OpenAI(base_url=child.url + "/v1", api_key=key)
    whole = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "count"}],
        max_tokens=TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    assert "".join(pieces) == whole.choices[0].message.content
