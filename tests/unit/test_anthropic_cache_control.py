"""Anthropic `cache_control` breakpoints: validation, where each one falls in the
prompt's tokens (through the embedded model's real chat template and tokenizer), the
usage they report and the price of cache writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_tokenizer import embedded_tokenizer
from tokenyard.api.anthropic.convert import anthropic_messages, anthropic_usage, cache_pins
from tokenyard.api.anthropic.schemas import MessagesRequest
from tokenyard.api.errors import parse_body
from tokenyard.errors import APIError
from tokenyard.gateway.billing import Billing, Usage
from tokenyard.store.money import Prices, cost_micros
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.prepare import Preparer

BS = 16
EPHEMERAL = {"type": "ephemeral"}
SYSTEM = "You answer questions about the solar system. " * 12


@pytest.fixture(scope="module")
def prepare(embedded_gguf_path: Path) -> Preparer:
    return Preparer(embedded_tokenizer(embedded_gguf_path), 8192)


def request(**body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 4, **body})


def prompt_of(prepare: Preparer, req: MessagesRequest) -> list[int]:
    return prepare.conversation(anthropic_messages(req), Timeline(), prefill=True)


def test_a_system_breakpoint_pins_the_system_turn_in_whole_blocks(prepare: Preparer) -> None:
    req = request(system=[{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}],
                  messages=[{"role": "user", "content": "Which planet is largest?"}])
    prompt = prompt_of(prepare, req)
    [(tokens, ttl)] = cache_pins(prepare, req, prompt, BS)
    system_turn = prepare.encode_rendered(
        prepare.template([{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
    assert ttl == 300.0
    assert prompt[:len(system_turn)] == system_turn  # the closed system turn is a prefix
    assert tokens == len(system_turn) // BS * BS and tokens > 0


def test_a_breakpoint_mid_message_covers_the_blocks_before_the_cut(prepare: Preparer) -> None:
    first, second = "Facts: " + "Mars is red. " * 20, "Question: why?"
    blocks = [{"type": "text", "text": first, "cache_control": {**EPHEMERAL, "ttl": "1h"}},
              {"type": "text", "text": second}]
    req = request(messages=[{"role": "user", "content": blocks}])
    prompt = prompt_of(prepare, req)
    [(tokens, ttl)] = cache_pins(prepare, req, prompt, BS)
    assert ttl == 3600.0
    # The cut renders "<user turn> first <end of turn>": only the part before the end of
    # turn prefixes the prompt, where the second block follows instead.
    head = prepare.encode_rendered(prepare.template(
        [{"role": "user", "content": first}], add_generation_prompt=False))
    common = next(i for i, (a, b) in enumerate(zip(head, prompt, strict=False)) if a != b)
    assert common < len(head)
    assert tokens == common // BS * BS and tokens > 0


def test_a_breakpoint_on_the_whole_prompt_leaves_its_last_token_unpinned(
    prepare: Preparer,
) -> None:
    req = request(messages=[{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": [
                                {"type": "text", "text": "Well " * 40,
                                 "cache_control": EPHEMERAL}]}])
    prompt = prompt_of(prepare, req)
    [(tokens, _)] = cache_pins(prepare, req, prompt, BS)
    assert tokens <= len(prompt) - 1 and tokens % BS == 0


def test_top_level_cache_control_pins_the_whole_conversation(prepare: Preparer) -> None:
    # Automatic caching: the breakpoint is the last message's last block, here a string.
    req = request(cache_control={**EPHEMERAL, "ttl": "1h"}, system=SYSTEM,
                  messages=[{"role": "user", "content": "Which planet is largest?"}])
    assert req.cache_breakpoints() == [(0, 0, 3600.0)]
    prompt = prompt_of(prepare, req)
    [(tokens, ttl)] = cache_pins(prepare, req, prompt, BS)
    assert ttl == 3600.0 and tokens == (len(prompt) - 1) // BS * BS  # all but the open turn
    marked = request(cache_control=EPHEMERAL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": EPHEMERAL}]}])
    assert marked.cache_breakpoints() == [(0, 1, 300.0)]  # already marked: counted once


def test_no_block_size_means_no_pins(prepare: Preparer) -> None:
    req = request(system=[{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}],
                  messages=[{"role": "user", "content": "Hi"}])
    assert cache_pins(prepare, req, prompt_of(prepare, req), None) == []


def test_five_breakpoints_are_refused_four_are_accepted() -> None:
    def body(n: int) -> dict[str, Any]:
        blocks = [{"type": "text", "text": f"part {i}", "cache_control": EPHEMERAL}
                  for i in range(n)]
        return {"messages": [{"role": "user", "content": blocks}]}

    assert len(request(**body(4)).cache_breakpoints()) == 4
    with pytest.raises(APIError) as info:
        parse_body(MessagesRequest, json.dumps({"model": "m", "max_tokens": 4, **body(5)}))
    assert info.value.status == 400
    assert "A maximum of 4 blocks with cache_control may be provided. Found 5." in \
        info.value.message


def test_a_bad_ttl_is_refused_naming_it() -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {**EPHEMERAL, "ttl": "2h"}}]}]}
    with pytest.raises(APIError) as info:
        parse_body(MessagesRequest, json.dumps(body))
    assert info.value.status == 400
    assert info.value.param == "messages.0.content.0.cache_control.ttl"


def test_usage_splits_read_written_and_plain_input() -> None:
    plain = anthropic_usage(100, 5, 32)
    assert (plain.input_tokens, plain.cache_read_input_tokens,
            plain.cache_creation_input_tokens) == (68, 32, 0)
    # The SDK's Usage has the split object in every body, zeros without breakpoints.
    assert plain.cache_creation.model_dump() == {"ephemeral_5m_input_tokens": 0,
                                                 "ephemeral_1h_input_tokens": 0}
    pinned = anthropic_usage(100, 5, 32, (16, 32))
    assert (pinned.input_tokens, pinned.cache_read_input_tokens,
            pinned.cache_creation_input_tokens) == (20, 32, 48)
    assert pinned.cache_creation.ephemeral_1h_input_tokens == 32


def test_cache_writes_cost_1_25x_and_2x_the_input_price() -> None:
    prices = Prices(input=3_000_000, cached_input=300_000, output=15_000_000)
    # A million tokens of each: $3 input, $0.30 read, $3.75 5-min write, $6 1-h write.
    assert cost_micros(prices, 0, 0, 0, 1_000_000) == 3_750_000
    assert cost_micros(prices, 0, 0, 0, 0, 1_000_000) == 6_000_000
    assert cost_micros(prices, 1, 1, 1, 1, 1) == 28  # 3 + 0.3 + 15 + 3.75 + 6 = 28.05
    usage = Usage(prompt_tokens=1000, cached_tokens=200, output_tokens=10,
                  cache_write_5m_tokens=300, cache_write_1h_tokens=100)
    assert Billing.cost(prices, usage) == cost_micros(prices, 400, 200, 10, 300, 100)
