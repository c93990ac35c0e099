"""The tool-call parser over streamed text (text/tools.py): any split of the output into
deltas gives the same text and calls as the whole; the rendering of tools, past calls and
results; the structural tag that forces calls."""

from __future__ import annotations

import itertools
import json

import pytest

from tokenyard.deployments import DEFAULT_MAX_TOOL_CALLS
from tokenyard.text.tool_calls import (
    CallArguments,
    CallStart,
    MarkupFilter,
    TextPiece,
    ToolCallParser,
    ToolEvent,
    split_tool_calls,
)
from tokenyard.text.tool_grammar import TEXT_EXCLUDES, constrained, markup_free, structural_tag
from tokenyard.text.tools import (
    MARKUP,
    PastCall,
    Tool,
    ToolChoice,
    ToolResult,
    ToolUse,
    assistant_text,
    assistant_turn,
    call_text,
    continues_results,
    result_turns,
    results_text,
    with_tools,
)
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams

NAMES = {"get_weather", "search"}
#: Those tools, the model free to answer in text.
AUTO = ToolUse(tuple(Tool(name) for name in sorted(NAMES)))

WEATHER = call_text("get_weather", '{"city": "Pa}ris \\"x\\" </tool_call>", "days": [1, {"a": 2}]}')
#: Text, a streamed-header call, a call whose keys come in another order (read whole), a
#: call of an unknown tool and one that is no JSON (both markup: dropped), then more text.
OUTPUT = (
    "Sure, let me look.\n"
    f"{WEATHER}\n"
    '<tool_call>{"arguments": {"q": "caf\u00e9"}, "name": "search"}</tool_call>\n'
    ' and <tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    "<tool_call>not json</tool_call> done."
)


def _ids() -> itertools.count[int]:
    return itertools.count()


def _run(pieces: list[str]) -> tuple[list[ToolEvent], ToolCallParser]:
    counter = _ids()
    parser = ToolCallParser(NAMES, lambda: f"id{next(counter)}")
    events: list[ToolEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events, parser


def _summary(events: list[ToolEvent]) -> tuple[str, dict[int, tuple[str, str, str]]]:
    text = "".join(e.text for e in events if isinstance(e, TextPiece))
    calls: dict[int, tuple[str, str, str]] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in calls, "a call starts once"
            calls[e.index] = (e.id, e.name, "")
        elif isinstance(e, CallArguments):
            call_id, name, args = calls[e.index]  # arguments only after the start
            calls[e.index] = (call_id, name, args + e.fragment)
    return text, calls


def test_whole_output_parses_into_text_and_calls() -> None:
    text, calls = _summary(_run([OUTPUT])[0])
    assert calls[0][1] == "get_weather"
    assert json.loads(calls[0][2]) == {"city": 'Pa}ris "x" </tool_call>', "days": [1, {"a": 2}]}
    assert calls[1][1:] == ("search", '{"q": "caf\u00e9"}')
    assert len(calls) == 2
    # A call of no given tool, and one that does not parse, are markup: never text.
    assert text == "Sure, let me look.\n and  done."


@pytest.mark.parametrize("cut", range(1, len(OUTPUT)))
def test_split_at_every_boundary_gives_the_same_result(cut: int) -> None:
    assert _summary(_run([OUTPUT[:cut], OUTPUT[cut:]])[0]) == _summary(_run([OUTPUT])[0])


def test_split_at_every_byte_boundary_of_utf8_one_character_at_a_time() -> None:
    # Deltas are text; a multi-byte character arrives whole once its last byte is in.
    raw = OUTPUT.encode()
    pieces, held = [], b""
    for i in range(len(raw)):
        held += raw[i:i + 1]
        try:
            pieces.append(held.decode())
            held = b""
        except UnicodeDecodeError:
            continue
    assert _summary(_run(pieces)[0]) == _summary(_run([OUTPUT])[0])


def test_arguments_stream_before_the_call_closes() -> None:
    counter = _ids()
    parser = ToolCallParser(NAMES, lambda: f"id{next(counter)}")
    events = parser.feed('<tool_call>{"name": "search", "arguments": {"q": "ab')
    assert events == [CallStart(0, "id0", "search"), CallArguments(0, '{"q": "ab')]
    assert parser.feed('c"}}</tool_call>') == [CallArguments(0, 'c"}')]
    assert parser.calls[0].complete and parser.calls[0].input == {"q": "abc"}


def test_text_that_only_looks_like_a_tag_is_released() -> None:
    events, _ = _run(["a <tool", "_ca", "t> b <to"])
    assert _summary(events) == ("a <tool_cat> b <to", {})


def test_whitespace_around_calls_is_dropped_but_text_keeps_its_spacing() -> None:
    text, calls = _summary(_run([f"Hi.\n\n{call_text('search', '{}')}\n\n"])[0])
    assert text == "Hi." and len(calls) == 1
    assert _summary(_run(["a  \n", " b  "])[0])[0] == "a  \n b  "


def test_unclosed_call_is_incomplete_and_never_text_when_finished() -> None:
    """A reply cut inside a call (max_tokens): the call is no call and its markup no
    text (issue 29: it reached `content` half-written)."""
    cut = '<tool_call>{"name": "search", "arguments": {"q": "x'
    _, parser = _run([cut])
    assert not parser.calls[0].complete
    text, calls = split_tool_calls("Hm. " + cut, AUTO, lambda: "c")
    assert (text, calls) == ("Hm.", [])
    text, calls = split_tool_calls(f"{call_text('search', '{}')}\n{cut}", AUTO, lambda: "c")
    assert text == "" and [c.name for c in calls] == ["search"]


def test_a_forced_reply_cut_inside_the_tag_is_no_text() -> None:
    """With calls forced the reply is calls only: ``<tool_`` cut by max_tokens is no
    text either (with `auto` it may be the reply's own text)."""
    forced = ToolUse(AUTO.tools, ToolChoice("required"))
    assert split_tool_calls("\n<tool_", forced, lambda: "c") == ("", [])
    assert split_tool_calls("a <tool_", AUTO, lambda: "c") == ("a <tool_", [])


def test_unfinished_header_is_dropped_at_the_end() -> None:
    events, parser = _run(['x\n<tool_call>{"name": "sea'])
    assert _summary(events) == ("x", {}) and not parser.calls


def test_split_tool_calls_numbers_valid_calls_in_order() -> None:
    bad = '<tool_call>{"name": "search", "arguments": {"q": nope}}</tool_call>'
    text, calls = split_tool_calls(f"{bad}{call_text('search', '{}')}", AUTO, lambda: "c")
    assert text == ""
    assert [(c.index, c.name, c.input) for c in calls] == [(0, "search", {})]


#: After a tool result SmolLM2 likes to write a result of its own, then answer: the result
#: is parsed out (not stopped on: the stop string ended such replies empty), the answer
#: stays; stray closing tags go too.
ECHOED = ("<tool_response>\nSunny, 21C\n</tool_response>\nIt is sunny</tool_call> in Paris."
          "</tool_response><tool_response>cut")


@pytest.mark.parametrize("cut", range(1, len(ECHOED)))
def test_a_result_the_model_writes_is_parsed_out_and_the_answer_stays(cut: int) -> None:
    events, parser = _run([ECHOED[:cut], ECHOED[cut:]])
    assert _summary(events) == ("\nIt is sunny in Paris.", {})
    assert not parser.made_calls


def test_markup_never_stays_in_text_without_tools() -> None:
    """With no active tool a reply has no calls; a call, a result and the tags the
    model writes are parsed out of its text all the same."""
    reply = (f"Hi {call_text('get_weather', '{}')} there <tool_response>x</tool_response>"
             "</tool_call>!")
    for use in (None, ToolUse(AUTO.tools, ToolChoice("none"))):
        text, calls = split_tool_calls(reply, use)
        assert (text, calls) == ("Hi  there !", [])  # the text's own spaces stay
        assert not any(tag in text for tag in MARKUP)


REPLY_WITH_MARKUP = (f"Hi {call_text('get_weather', '{}')} there <tool_response>x"
                     "</tool_response></tool_call>! a < b")


@pytest.mark.parametrize("cut", range(1, len(REPLY_WITH_MARKUP)))
def test_a_stream_without_tools_has_its_markup_parsed_out_at_every_split(cut: int) -> None:
    """Streamed without active tools (no tools, or `tool_choice: none`), the text that
    goes out is the finished reply's clean text, however the deltas split the markup."""
    for use in (None, ToolUse(AUTO.tools, ToolChoice("none"))):
        plain = MarkupFilter(use)
        text = plain.feed(REPLY_WITH_MARKUP[:cut]) + plain.feed(REPLY_WITH_MARKUP[cut:], True)
        assert text == split_tool_calls(REPLY_WITH_MARKUP, use)[0] == "Hi  there ! a < b"


def test_the_grammar_keeps_markup_out_of_free_text() -> None:
    """The structural tag of `auto` (one call, several, or `none`'s text alone) accepts
    an answer and a call, and refuses a result the model writes, its variants and a stray
    closing tag."""
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    weather = call_text("get_weather", '{"city": "Paris"}')
    specs = [structural_tag(AUTO, 1), structural_tag(AUTO, 3), structural_tag(AUTO, None)]
    for spec in specs:
        grammar = xgrammar.Grammar.from_structural_tag(json.dumps(spec))
        assert _is_grammar_accept_string(grammar, "It is sunny.")
        assert _is_grammar_accept_string(grammar, f"Let me see. {weather}")
        for bad in ("<tool_response>\nSunny\n</tool_response>", "<tool_response_json>{}",
                    "It is sunny.</tool_response>", "<tools>x</tools>"):
            assert not _is_grammar_accept_string(grammar, bad), (spec, bad)
    one_call = xgrammar.Grammar.from_structural_tag(json.dumps(specs[0]))
    for empty in ("", "\n", "\n\n"):  # a reply that answers nothing
        assert not _is_grammar_accept_string(one_call, empty)
    text_only = xgrammar.Grammar.from_structural_tag(json.dumps(markup_free()))
    assert _is_grammar_accept_string(text_only, "It is sunny, 21C.")
    assert not _is_grammar_accept_string(text_only, weather)
    assert not _is_grammar_accept_string(text_only, "<tool_response>x")
    assert set(TEXT_EXCLUDES) <= {*specs[2]["format"]["elements"][0]["excludes"]}


def test_results_that_end_the_conversation_continue_the_calling_turn() -> None:
    """Results right after the turn that made the calls continue it, and the reply
    goes on from there; results followed by the user's text, or after no call, stay a
    user turn; a template that renders tools gets `tool` messages as before."""
    use = ToolUse(TOOLS)
    call = assistant_turn({"role": "assistant", "content": "Let me see."},
                          [PastCall("get_weather", '{"city": "Paris"}')], native=False)
    ask = {"role": "user", "content": "Weather in Paris?"}
    results = result_turns([ToolResult("Sunny, 21C"), ToolResult("oops", None, True)], False)
    messages = with_tools([ask, call, *results], use)
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[-1]["content"] == (
        'Let me see.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call>\n<tool_response>\nSunny, 21C\n</tool_response>\n"
        "<tool_response>\nError: oops\n</tool_response>\n")
    assert continues_results(messages)
    followed = with_tools([ask, call, *result_turns([ToolResult("x")], False, "and?")], use)
    assert followed[-1]["role"] == "user" and not continues_results(followed)
    assert with_tools([ask, *results], use)[-1] == results[0]  # no calling turn before
    native = [ask, assistant_turn({"role": "assistant", "content": ""},
                                  [PastCall("search", "{}")], native=True),
              *result_turns([ToolResult("x")], True)]
    assert with_tools(native, use, native=True) == native


def test_arguments_given_as_a_json_string_are_read() -> None:
    body = '<tool_call>{"arguments": "{\\"q\\": 1}", "name": "search"}</tool_call>'
    _, calls = split_tool_calls(body, AUTO, lambda: "c")
    assert calls[0].input == {"q": 1}


# ---------------------------------------------------------------------------- rendering

TOOLS = (Tool("get_weather", "Weather now", {"type": "object",
                                              "properties": {"city": {"type": "string"}}}),
         Tool("search", None, {}))


def test_tools_join_the_system_prompt_or_open_the_conversation() -> None:
    use = ToolUse(TOOLS)
    merged = with_tools([{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "hi"}], use)
    assert merged[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in merged[0]["content"] and len(merged) == 2
    added = with_tools([{"role": "user", "content": "hi"}], use)
    assert added[0]["role"] == "system" and len(added) == 2
    assert with_tools([{"role": "user", "content": "hi"}],
                      ToolUse(TOOLS, ToolChoice("none"))) == [{"role": "user", "content": "hi"}]


def test_named_choice_lists_only_that_tool() -> None:
    prompt = with_tools([], ToolUse(TOOLS, ToolChoice("required", "search")))[0]["content"]
    assert '"name": "search"' in prompt and "get_weather" not in prompt


def test_past_calls_and_results_render_back_readably() -> None:
    text = assistant_text("Checking.", [PastCall("search", '{"q": 1}')])
    assert text == 'Checking.\n<tool_call>{"name": "search", "arguments": {"q": 1}}</tool_call>'
    assert split_tool_calls(text, AUTO, lambda: "c")[1][0].input == {"q": 1}
    assert results_text([ToolResult("17 C", "get_weather"), ToolResult("oops", None, True)]) == (
        "<tool_response>\n17 C\n</tool_response>\n<tool_response>\nError: oops\n</tool_response>"
    )


def test_structural_tag_forces_the_offered_tools() -> None:
    tag = structural_tag(ToolUse(TOOLS, ToolChoice("required", "search", parallel=False)))
    fmt = tag["format"]
    assert fmt["type"] == "tags_with_separator"  # calls only, nothing else
    assert fmt["at_least_one"] and fmt["stop_after_first"]
    assert [t["begin"] for t in fmt["tags"]] == ['<tool_call>{"name": "search", "arguments": ']
    assert fmt["tags"][0]["content"]["json_schema"] == {"type": "object"}
    auto = structural_tag(ToolUse(TOOLS))["format"]
    assert auto["type"] == "or"  # a call first, or text (never an empty reply)
    auto = auto["elements"][1]["elements"][1]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"]
    assert not auto["at_least_one"] and not auto["stop_after_first"]
    assert len(auto["tags"]) == 2


def test_constrained_sets_a_grammar_only_for_active_tools() -> None:
    params = SamplingParams()
    guided = constrained(params, ToolUse(TOOLS)).guided
    assert guided is not None and guided.kind == "structural_tag" and guided.param == "tools"
    assert constrained(params, ToolUse(TOOLS)).stop == []  # parsed, not stopped on
    assert json.loads(guided.spec) == structural_tag(ToolUse(TOOLS), DEFAULT_MAX_TOOL_CALLS)
    none = constrained(params, ToolUse(TOOLS, ToolChoice("none"))).guided
    assert none is not None and json.loads(none.spec) == markup_free()
    assert constrained(params, None) is params


def test_a_forced_call_takes_the_grammar_from_a_response_format() -> None:
    """With a text format and tools, `auto` keeps the format (the model may answer in
    text); `required` or a named tool forces calls, whose grammar replaces it."""
    fmt = GuidedDecoding("json_object", "", param="response_format")
    params = SamplingParams(guided=fmt)
    assert constrained(params, ToolUse(TOOLS)).guided == fmt
    for choice in (ToolChoice("required"), ToolChoice("required", "search")):
        guided = constrained(params, ToolUse(TOOLS, choice)).guided
        assert guided is not None and guided.kind == "structural_tag", choice


# ---------------------------------------------------------------------------- native templates

#: A template in the style of those that render tools (Hermes / Qwen 2.5): the schemas in
#: the system turn, past calls from `tool_calls`, results as `tool` turns.
NATIVE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_template_that_uses_tools_renders_them_natively() -> None:
    from tokenyard.text.chat_template import render_chat
    from tokenyard.text.model_files import embedded_model_path
    from tokenyard.text.tokenizer import Tokenizer
    from tokenyard.text.tools import assistant_turn, renders_tools, result_turns, template_tools

    assert renders_tools(NATIVE)
    # SmolLM2 (the embedded model) renders no tools: it gets the system-prompt fallback.
    assert not renders_tools(Tokenizer.from_gguf(embedded_model_path()).chat_template)
    use = ToolUse(TOOLS, ToolChoice("required", "search"))
    messages = [
        {"role": "user", "content": "hi"},
        assistant_turn({"role": "assistant", "content": ""},
                       [PastCall("search", '{"q": 1}')], native=True),
        *result_turns([ToolResult("found", "search")], native=True, text="thanks"),
    ]
    assert with_tools(messages, use, native=True) == messages  # no system prompt added
    text = render_chat(NATIVE, messages, tools=template_tools(use, native=True))
    assert text == (
        '<|system|>{"type": "function", "function": {"name": "search", "parameters": {}}}\n'
        '<|user|>hi<|assistant|><call>search {"q": 1}</call><|tool|>found'
        "<|user|>thanks<|assistant|>"  # (trim_blocks eats the newline after a block)
    )
    assert template_tools(use, native=False) is None
    fallback = result_turns([ToolResult("found", "search")], native=False, text="thanks")
    assert fallback == [{"role": "user",
                         "content": "<tool_response>\nfound\n</tool_response>\nthanks"}]
