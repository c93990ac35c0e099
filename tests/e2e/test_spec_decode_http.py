"""`tokenyard serve --speculative-config '{"method": "ngram", ...}'`: the flag reaches the
replica, whose engine then drafts by n-gram lookup and verifies the drafts in one step
(engine/spec/); the answers through the OpenAI SDK, streamed and not, are the ones the
engine gives without drafts, and the replica's stats and /metrics count the drafts."""

from __future__ import annotations

import httpx2
import openai

from tests.e2e.conftest import replica_get, running_server
from tests.integration.test_spec_decode import COPY, FREE
from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams

SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'


def test_served_with_speculation_answers_as_the_engine_without_it() -> None:
    llm = LLM()  # the same weights as serve's default, no drafts
    expected = [r.text for r in llm.generate([COPY, FREE], SamplingParams(
        temperature=0.0, max_tokens=48))]
    with running_server("--no-auth", "--speculative-config", SPEC) as (server, _):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none",
                               max_retries=0)
        plain = client.chat.completions.create(
            model=server.model, messages=COPY, temperature=0, max_tokens=48)  # type: ignore[arg-type]
        stream = client.chat.completions.create(
            model=server.model, messages=FREE, temperature=0, max_tokens=48,  # type: ignore[arg-type]
            stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        stats = replica_get(server, "/v1/engine/stats")
        metrics = httpx2.get(server.base_url + "/metrics").text
    assert [plain.choices[0].message.content, streamed] == expected
    assert 0 < stats["num_accepted_draft_tokens"] <= stats["num_draft_tokens"]
    assert "tokenyard:spec_decode_num_accepted_tokens_total" in metrics
