"""Tool markup the model writes never reaches a streamed reply's content, with or without
tools (issue 41): the chat chunks, the Messages events and the Responses events of a reply
without active tools carry its text with the calls, results and stray tags parsed out."""

from __future__ import annotations

import pytest

from tokenyard.api.anthropic.stream import AnthropicStream
from tokenyard.api.openai.stream import ChatStream
from tokenyard.api.responses.convert import response_shell
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.api.responses.stream import ResponsesFormat
from tokenyard.text.tools import MARKUP, Tool, ToolChoice, ToolUse, call_text
from tokenyard.wire.outputs import CompletionDelta, RequestOutput

#: A reply to a tool result as SmolLM2 likes to write it: its own result echoed, a call of
#: a tool it was not given, a stray closing tag; split inside the tags.
REPLY = ("<tool_response>\nSunny, 21C\n</tool_response>\nIt is sunny "
         + call_text("get_weather", '{"city": "Paris"}') + "in Paris.</tool_call>")
PIECES = [REPLY[i:i + 5] for i in range(0, len(REPLY), 5)]
CLEAN = "\nIt is sunny in Paris."
NONE = ToolUse((Tool("get_weather"),), ToolChoice("none"))


def _deltas() -> list[CompletionDelta]:
    last = len(PIECES) - 1
    return [CompletionDelta(0, p, [i], None, "stop" if i == last else None, None)
            for i, p in enumerate(PIECES)]


@pytest.mark.parametrize("use", [None, NONE], ids=["no-tools", "tool_choice-none"])
def test_chat_chunks(use: ToolUse | None) -> None:
    stream = ChatStream(id="chatcmpl-x", model="m", created=1, tools=use)
    chunks = [c for d in _deltas() for c in stream.delta_chunks(d)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.strip() == CLEAN.strip() and not any(t in text for t in MARKUP)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("use", [None, NONE], ids=["no-tools", "tool_choice-none"])
def test_messages_events(use: ToolUse | None) -> None:
    stream = AnthropicStream(id="msg_x", model="m", tools=use)
    events = stream.start_events(prompt_tokens=3)
    for d in _deltas():
        events += stream.delta_events(d, prompt_tokens=3, output_tokens=d.token_ids[0] + 1)
    text = "".join(e.delta.text for e in events  # type: ignore[attr-defined]
                   if e.type == "content_block_delta")
    assert text.strip() == CLEAN.strip() and not any(t in text for t in MARKUP)
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta",
                                             "message_stop"]


def test_responses_events() -> None:
    fmt = ResponsesFormat(response_shell(ResponsesRequest(model="m", input="x"), "m"), None)
    events = [e for d in _deltas() for e in fmt.events(0, RequestOutput(
        "r", [d], d.finish_reason is not None, 3, 0, 1))]
    text = "".join(e.delta for e in events  # type: ignore[attr-defined]
                   if e.type == "response.output_text.delta")
    assert text.strip() == CLEAN.strip() and not any(t in text for t in MARKUP)
