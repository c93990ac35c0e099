"""Anthropic prompt caching through the official SDK against `tokenyard serve`: a
`cache_control` breakpoint writes its prefix to the cache, the next request reads it,
the replica keeps the pinned blocks through a flood that evicts unpinned ones, the
ledger prices writes and reads, and a fifth breakpoint is a 400 in Anthropic's shape.

The server gets a small KV pool, so that a handful of prompts cycle every unpinned block.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import pytest

from tests.e2e.conftest import Server, replica_get, running_server
from tests.e2e.test_gateway import _ledger_rows, _poll, _with_store
from tokenyard.store import Prices, Store, cost_micros

pytestmark = pytest.mark.slow

#: Odd prices (micros per million tokens) so that rounding shows; writes follow input.
PRICES = Prices(input=3_000_001, cached_input=300_007, output=15_000_011)
KV_CACHE_GIB = "0.05"  # about 70 blocks of 16 tokens for SmolLM2-135M in float32
EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}


def long_text(topic: str, words: int = 70) -> str:
    """A distinct text of about 4 tokens a word (distinct from its first block on)."""
    return f"Notes on {topic}: " + " ".join(f"{topic}{i % 97}" for i in range(words))


@dataclass(frozen=True)
class Cached:
    server: Server
    state_dir: str
    client: anthropic.Anthropic
    key_id: str
    num_kv_blocks: int
    block_size: int

    def ask(self, system: Any, *, question: str = "Summarise in one word.") -> Any:
        return self.client.messages.create(
            model=self.server.model, max_tokens=1, system=system,
            messages=[{"role": "user", "content": question}], extra_body={"temperature": 0})

    def replica(self, path: str) -> dict[str, Any]:
        return replica_get(self.server, path)


@pytest.fixture(scope="module")
def cached() -> Iterator[Cached]:
    state = tempfile.mkdtemp(prefix="tokenyard-e2e-cache-")
    try:
        with running_server(state_dir=state, env={"TOKENYARD_KV_CACHE_GIB": KV_CACHE_GIB}
                            ) as (server, _):
            async def setup(store: Store) -> tuple[str, str]:
                await store.set_price(server.model, input=PRICES.input,
                                      cached_input=PRICES.cached_input, output=PRICES.output)
                org = await store.create_org(f"e2e-cache-{uuid.uuid4().hex[:8]}")
                secret, key = await store.create_api_key(org.id, name="cache")
                return secret, key.id

            secret, key_id = _with_store(state, setup)
            client = anthropic.Anthropic(base_url=server.base_url, api_key=secret,
                                         max_retries=0)
            info = replica_get(server, "/v1/engine/info")
            yield Cached(server, state, client, key_id, info["num_kv_blocks"],
                         info["block_size"])
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_a_breakpoint_writes_then_reads_and_survives_a_flood_that_evicts_the_rest(
    cached: Cached,
) -> None:
    pinned = [{"type": "text", "text": long_text("saturn"), "cache_control": EPHEMERAL}]
    first = cached.ask(pinned).usage
    assert first.cache_creation_input_tokens > 0 and first.cache_read_input_tokens == 0
    assert first.cache_creation.ephemeral_5m_input_tokens == first.cache_creation_input_tokens
    assert first.cache_creation_input_tokens % cached.block_size == 0
    count = cached.client.messages.count_tokens(
        model=cached.server.model, system=pinned,
        messages=[{"role": "user", "content": "Summarise in one word."}]).input_tokens
    assert first.input_tokens + first.cache_creation_input_tokens == count

    second = cached.ask(pinned).usage
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    assert second.input_tokens + second.cache_read_input_tokens == count
    assert cached.replica("/v1/engine/stats")["num_pinned_kv_blocks"] >= (
        first.cache_creation_input_tokens // cached.block_size)

    # A control prompt without a breakpoint: cached (LRU) like any other, until a flood.
    control = long_text("neptune")
    cached.ask(control)
    assert cached.ask(control).usage.cache_read_input_tokens > 0
    blocks_per_prompt = count // cached.block_size
    for i in range(cached.num_kv_blocks // blocks_per_prompt + 3):
        cached.ask(long_text(f"flood{i}x"))

    assert cached.ask(control).usage.cache_read_input_tokens == 0  # evicted
    after = cached.ask(pinned).usage
    assert after.cache_read_input_tokens >= first.cache_creation_input_tokens  # kept


def test_the_ledger_prices_cache_writes_and_reads(cached: Cached) -> None:
    hour = [{"type": "text", "text": long_text("jupiter"),
             "cache_control": {**EPHEMERAL, "ttl": "1h"}}]
    written = cached.ask(hour).usage
    assert written.cache_creation.ephemeral_1h_input_tokens > 0
    assert written.cache_creation.ephemeral_5m_input_tokens == 0
    read = cached.ask(hour).usage
    assert read.cache_read_input_tokens > 0 and read.cache_creation_input_tokens == 0

    # The one row with an hour-long write, then the next one (rows of earlier tests may
    # still be on their way: the writer flushes in batches).
    def pair(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        at = next((i for i, r in enumerate(rows) if r["cache_write_1h_tokens"] > 0), None)
        return (rows[at], rows[at + 1]) if at is not None and at + 1 < len(rows) else None

    found = _poll(lambda: pair(_ledger_rows(cached.state_dir, cached.key_id)),
                  lambda p: p is not None, 5.0, "the write and read rows")
    assert found is not None
    write_row, read_row = found
    w = written.cache_creation_input_tokens
    assert write_row["cache_write_1h_tokens"] == w and write_row["cache_write_5m_tokens"] == 0
    assert write_row["prompt_tokens"] == written.input_tokens + w
    assert write_row["cost_micros"] == cost_micros(
        PRICES, written.input_tokens, 0, written.output_tokens, 0, w)
    assert write_row["cost_micros"] > cost_micros(
        PRICES, written.input_tokens + w, 0, written.output_tokens)  # a write costs more
    r = read.cache_read_input_tokens
    assert read_row["cached_tokens"] == r and read_row["cache_write_1h_tokens"] == 0
    assert read_row["cost_micros"] == cost_micros(
        PRICES, read.input_tokens, r, read.output_tokens)


def test_five_breakpoints_are_a_400_in_anthropics_shape(cached: Cached) -> None:
    blocks = [{"type": "text", "text": f"part {i}", "cache_control": EPHEMERAL}
              for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as info:
        cached.client.messages.create(model=cached.server.model, max_tokens=1,
                                      messages=[{"role": "user", "content": blocks}])
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "A maximum of 4 blocks with cache_control may be provided. Found 5." \
        in body["error"]["message"]


def test_a_stream_reports_the_cache_write_then_a_read(cached: Cached) -> None:
    pinned = [{"type": "text", "text": long_text("uranus"), "cache_control": EPHEMERAL}]
    with cached.client.messages.stream(
        model=cached.server.model, max_tokens=1, system=pinned,
        messages=[{"role": "user", "content": "Summarise in one word."}],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    assert start.cache_creation_input_tokens == final.usage.cache_creation_input_tokens > 0
    assert final.usage.cache_read_input_tokens == 0
    again = cached.ask(pinned).usage
    assert again.cache_read_input_tokens >= final.usage.cache_creation_input_tokens
