"""`tokenyard serve --speculative-config '{"method": "draft_model", ...}'`: the replica
loads the draft model beside the target (here the embedded model drafts for itself) and
its answers through the OpenAI SDK are the ones the engine gives without drafts; the
replica's stats count the draft model's drafts."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.e2e.conftest import replica_get, running_server
from tests.integration.test_spec_decode import COPY
from tests.integration.test_spec_draft import draft_spec
from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams


def test_served_with_a_draft_model_answers_as_the_engine_without_it(
        embedded_gguf_path: Path) -> None:
    expected = LLM().generate([COPY], SamplingParams(temperature=0.0, max_tokens=32))[0].text
    with running_server("--no-auth", "--speculative-config",
                        draft_spec(embedded_gguf_path)) as (server, _):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none",
                               max_retries=0)
        stream = client.chat.completions.create(
            model=server.model, messages=COPY, temperature=0, max_tokens=32,  # type: ignore[arg-type]
            stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        stats = replica_get(server, "/v1/engine/stats")
    assert streamed == expected
    assert 0 < stats["num_accepted_draft_tokens"] <= stats["num_draft_tokens"]
