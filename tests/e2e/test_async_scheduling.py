"""`tokenyard serve --async-scheduling on`: the flag reaches the replica, whose engine then
plans each step while the one before computes (engine/core.py), and the answers through
the OpenAI SDK are the ones the step-by-step engine gives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from tests.e2e.conftest import replica_get, running_server
from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams

QUESTIONS = ["Name three colors.", "What is two plus two?", "Write a haiku about the sea.",
             "Why is the sky blue?"]


def test_served_with_async_scheduling_answers_as_the_step_by_step_engine() -> None:
    llm = LLM()  # the same weights as serve's default, stepped one step at a time
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    expected = [r.text for r in llm.generate(chats, SamplingParams(temperature=0.0,
                                                                   max_tokens=48))]
    assert llm.core.stats().num_overlapped_steps == 0
    with running_server("--no-auth", "--async-scheduling", "on") as (server, _):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none",
                               max_retries=0)

        def ask(chat: list[dict[str, str]]) -> str:
            stream = client.chat.completions.create(
                model=server.model, messages=chat, temperature=0, max_tokens=48,  # type: ignore[arg-type]
                stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        alone = ask(chats[0])  # one stream: every step after its first overlaps
        with ThreadPoolExecutor(len(chats)) as pool:
            together = list(pool.map(ask, chats))
        stats = replica_get(server, "/v1/engine/stats")
    assert alone == expected[0]
    assert together == expected
    assert stats["num_overlapped_steps"] >= 40
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
