"""Each family's tool-call syntax (text/tool_formats.py, through tool_calls.py's parser)
and Qwen3's reasoning (text/reasoning.py) on canned model output in the format each
family documents, whole and streamed in pieces of every size."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from tokenyard.deployments import load_fleet
from tokenyard.fleet_values import FleetConfigError
from tokenyard.text.reasoning import (
    ReasoningCounter,
    ReasoningParser,
    count_reasoning_tokens,
    detect_reasoning_parser,
    prompt_opens_reasoning,
    reasoning_parser,
    split_reasoning,
)
from tokenyard.text.tool_calls import (
    CallArguments,
    CallStart,
    TextPiece,
    ToolCallParser,
    split_tool_calls,
)
from tokenyard.text.tool_formats import TOOL_CALL_PARSERS, detect_tool_parser, native_calls
from tokenyard.text.tools import Tool, ToolUse

TOOLS = (Tool("get_weather"), Tool("search"))
WEATHER = {"city": "Paris", "unit": "celsius"}
SEARCH = {"q": "a \"quoted\" [bracket] {brace}; semi"}

#: parser -> [(model output, expected text, expected calls [(name, arguments)])]
CANNED: dict[str, list[tuple[str, str, list[tuple[str, dict[str, Any]]]]]] = {
    "qwen3": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Paris", "unit": "celsius"}}\n</tool_call>', "Let me check.",
         [("get_weather", WEATHER)]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
         [("get_weather", WEATHER)]),
        ('<|python_tag|>{"name": "search", "parameters": ' + json.dumps(SEARCH) + "}", "",
         [("search", SEARCH)]),
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "search", "parameters": ' + json.dumps(SEARCH) + "}", "",
         [("get_weather", WEATHER), ("search", SEARCH)]),
        ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call: text as written
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
         '"unit": "celsius"}}, {"name": "search", "arguments": ' + json.dumps(SEARCH) + "}]",
         "", [("get_weather", WEATHER), ("search", SEARCH)]),
        ('Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
         '[TOOL_CALLS]search[ARGS]' + json.dumps(SEARCH), "Checking.",
         [("get_weather", WEATHER), ("search", SEARCH)]),
        ("No [tools] needed: [1, 2].", "No [tools] needed: [1, 2].", []),
        ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
        # [TOOL_CALLS] is a control token: the default skip_special_tokens drops it
        (' [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
         "", [("get_weather", WEATHER)]),
        ('[{"a": 1}] is a list of one object.', '[{"a": 1}] is a list of one object.', []),
        ("[ 1, 2 ] as text", "[ 1, 2 ] as text", []),
    ],
    "phi4_mini_json": [
        ('functools[{"name": "get_weather", "arguments": {"city": "Paris", '
         '"unit": "celsius"}}]', "", [("get_weather", WEATHER)]),
        ('Sure. functools[{"name": "search", "arguments": ' + json.dumps(SEARCH) + "}]",
         "Sure.", [("search", SEARCH)]),
        ("plain answer", "plain answer", []),
    ],
}
CASES = [(parser, *case) for parser, cases in CANNED.items() for case in cases]


def _ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    text: list[str] = []
    calls: dict[int, list[str]] = {}
    events = [event for piece in pieces for event in parser.feed(piece)]
    for event in events + parser.finish():
        if isinstance(event, TextPiece):
            text.append(event.text)
        elif isinstance(event, CallStart):
            calls[event.index] = [event.name, ""]
        elif isinstance(event, CallArguments):
            calls[event.index][1] += event.fragment
    return "".join(text), [(name, args) for name, args in calls.values()]


@pytest.mark.parametrize(("parser", "output", "text", "calls"), CASES)
def test_finished_output_splits_into_text_and_calls(
        parser: str, output: str, text: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    got_text, got_calls = split_tool_calls(output, ToolUse(TOOLS, syntax=parser), _ids())
    assert got_text == text
    assert [(c.name, c.input) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize(("parser", "output", "text", "calls"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_output_in_pieces_of_any_size_gives_the_same(
        parser: str, output: str, text: str, calls: list[tuple[str, dict[str, Any]]],
        size: int) -> None:
    stream = ToolCallParser({t.name for t in TOOLS}, _ids(), syntax=parser)
    pieces = [output[i:i + size] for i in range(0, len(output), size)]
    got_text, got_calls = _streamed(stream, pieces)
    assert got_text == text
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


def test_a_call_of_an_unknown_tool_is_no_call_and_no_text() -> None:
    """Issue 41: tool markup never reaches the content; a call of no given tool is
    dropped (it was text before)."""
    output = '[TOOL_CALLS][{"name": "delete_all", "arguments": {}}]'
    text, calls = split_tool_calls(output, ToolUse(TOOLS, syntax="mistral"), _ids())
    assert calls == []
    assert "delete_all" not in text


def test_unknown_parser_names_are_refused_and_every_known_one_builds() -> None:
    for name in TOOL_CALL_PARSERS:
        native_calls(name)
    with pytest.raises(ValueError, match="unknown tool-call parser 'pythonic'"):
        native_calls("pythonic")
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        reasoning_parser("o1")


@pytest.mark.parametrize(("template", "tool", "reasoning"), [
    ("{%- if tools %}<tool_call>\n{{ tool_call | tojson }}</tool_call>{% endif %}"
     "{{ '<think>\\n' }}", "hermes", "qwen3"),
    ("<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' + tool_call }}",
     "llama3_json", None),
    ("<|start_header_id|>user<|end_header_id|>Respond in the format "
     "{\"name\": function name, \"parameters\": dictionary}", "llama3_json", None),
    ("{{- '[AVAILABLE_TOOLS]' }}{{- '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral", None),
    ("{{ '<|system|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' }}",
     "phi4_mini_json", None),
    ("{{ '<|im_start|>' + message['role'] }}", "hermes", None),
    (None, "hermes", None),
])
def test_parsers_are_detected_from_the_chat_template(
        template: str | None, tool: str, reasoning: str | None) -> None:
    assert detect_tool_parser(template) == tool
    assert detect_reasoning_parser(template) == reasoning


# --------------------------------------------------------------------------- reasoning

REASONING_CASES = [
    # (output, prompt opened the block, reasoning, content)
    ("<think>\nThe user wants 2+2.\n</think>\n\n4", False, "\nThe user wants 2+2.\n", "\n4"),
    ("  <think>a < b, so </thin is no tag</think>Yes.", False, "a < b, so </thin is no tag",
     "Yes."),
    ("<think>\n\n</think>\n\nHello!", False, "\n\n", "\nHello!"),  # thinking switched off
    ("Just an answer.", False, "", "Just an answer."),
    ("<thinking is not the tag", False, "", "<thinking is not the tag"),
    ("Reasoning in the prompt's block.</think>\nAnswer.", True,
     "Reasoning in the prompt's block.", "Answer."),
    ("<think>cut off mid-thought", False, "cut off mid-thought", ""),
]


@pytest.mark.parametrize(("output", "inside", "reasoning", "content"), REASONING_CASES)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_qwen3_reasoning_splits_from_the_answer_whole_and_streamed(
        output: str, inside: bool, reasoning: str, content: str, size: int) -> None:
    parser = reasoning_parser("qwen3", inside=inside)
    assert parser is not None
    got_reasoning, got_content = "", ""
    for i in range(0, len(output), size):
        delta = parser.feed(output[i:i + size])
        got_reasoning += delta.reasoning
        got_content += delta.content
    last = parser.finish()
    assert (got_reasoning + last.reasoning, got_content + last.content) == (reasoning, content)
    whole = ReasoningParser("<think>", "</think>", inside=inside)
    assert split_reasoning(output, whole) == (reasoning, content)


def test_reasoning_then_a_tool_call_both_parse() -> None:
    output = ('<think>I need the weather.</think>\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    parser = reasoning_parser("qwen3")
    assert parser is not None
    reasoning, content = split_reasoning(output, parser)
    assert reasoning == "I need the weather."
    text, calls = split_tool_calls(content, ToolUse(TOOLS, syntax="qwen3"), _ids())
    assert text == "" and [(c.name, c.input) for c in calls] == [("get_weather", WEATHER)]


def test_an_open_block_at_the_end_of_the_prompt_is_seen() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", "qwen3")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", "qwen3")
    assert not prompt_opens_reasoning("<think>\n", None)


def test_a_fleet_file_picks_a_deployments_parsers_and_refuses_unknown_ones(
        tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('[[deployments]]\nname = "m"\nurls = ["http://127.0.0.1:1"]\n'
                    'tool_call_parser = "mistral"\nreasoning_parser = "none"\n')
    spec = load_fleet(path).deployments["m"]
    assert (spec.tool_call_parser, spec.reasoning_parser) == ("mistral", "none")
    path.write_text('[[deployments]]\nname = "m"\nurls = ["http://127.0.0.1:1"]\n')
    spec = load_fleet(path).deployments["m"]
    assert (spec.tool_call_parser, spec.reasoning_parser) == ("auto", "auto")
    path.write_text('[[deployments]]\nname = "m"\nurls = ["http://127.0.0.1:1"]\n'
                    'tool_call_parser = "pythonic"\n')
    with pytest.raises(FleetConfigError, match=r"deployments\[0\]\.tool_call_parser: one of "
                                               r"auto, hermes, .*not 'pythonic'"):
        load_fleet(path)


@pytest.mark.parametrize(("pieces", "expected"), [
    (["<th", "ink>", "a b", "</", "think", ">", "answer", " more"], 6),  # tag split 3 ways
    (["  <think>", "x", "</think>"], 3),
    (["answer", "<think>", "</think>"], 0),  # no block at the start
    (["<think>", "cut", " off"], 3),  # never closed: all of it
    (["<", "b>bold</b>"], 0),
])
def test_reasoning_tokens_are_counted_from_token_bytes_as_they_stream(
        pieces: list[str], expected: int) -> None:
    def token_bytes(token_id: int) -> bytes:
        return pieces[token_id].encode()

    ids = list(range(len(pieces)))
    assert count_reasoning_tokens(ids, token_bytes, "qwen3") == expected
    counter = ReasoningCounter(token_bytes, "qwen3")
    for i in ids:
        counter.push([i], finished=i == ids[-1])
    assert counter.count == expected


def test_a_block_the_prompt_opened_counts_from_the_first_token() -> None:
    pieces = ["x", " y", "</think>", "answer"]

    def token_bytes(token_id: int) -> bytes:
        return pieces[token_id].encode()

    assert count_reasoning_tokens(range(4), token_bytes, "qwen3", inside=True) == 3
    assert count_reasoning_tokens(range(4), token_bytes, "qwen3") == 0
