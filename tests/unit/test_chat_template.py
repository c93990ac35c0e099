"""Chat template rendering, checked against transformers' apply_chat_template."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_tokenizer import embedded_tokenizer
from tokenyard.text.chat_template import DEFAULT_CHATML_TEMPLATE, ChatTemplateError, render_chat

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Hi! 你好 😀"}
ASSISTANT = {"role": "assistant", "content": "Hello."}
USER2 = {"role": "user", "content": "What is 2+2?"}

CONVERSATIONS = {
    "single_user": [USER],
    "with_system": [SYSTEM, USER],
    "multi_turn": [USER, ASSISTANT, USER2],
    "multi_turn_with_system": [SYSTEM, USER, ASSISTANT, USER2],
    "ends_with_assistant": [USER, ASSISTANT],
}

# Exercises what real templates use: tools|tojson with indent, namespace, loop controls,
# raise_exception, bos/eos tokens, extra variables and {% generation %}.
TOOL_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for m in messages %}
  {% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}
{% endfor %}
{% if tools %}Tools:
{{ tools | tojson(indent=2) }}
{% endif %}
System: {{ ns.system }}
{% for m in messages if m['role'] != 'system' %}
  {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
  {% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}{{ eos_token }}
{% endgeneration %}{% else %}U: {{ m['content'] | trim }}
{% endif %}
  {% if loop.index >= 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}A:{% if enable_thinking %} <think>{% endif %}{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find <things> & stuff — fast",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def _transformers_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """Render with transformers' own chat template machinery (an independent implementation)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    # A one-word tokenizer is enough: tokenize=False only renders the template.
    backend = Backend(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    rendered = reference.apply_chat_template(
        messages, chat_template=template, tokenize=False, **kwargs
    )
    assert isinstance(rendered, str)
    return rendered


@pytest.fixture(scope="module")
def smollm2_template(embedded_gguf_path: Path) -> str:
    template = embedded_tokenizer(embedded_gguf_path).chat_template
    assert template is not None
    return template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_template_matches_transformers(
    smollm2_template: str, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    ours = render_chat(
        smollm2_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    expected = _transformers_render(
        smollm2_template, messages, add_generation_prompt=add_generation_prompt
    )
    assert ours == expected


def test_smollm2_template_adds_default_system_prompt_only_without_system(
    smollm2_template: str,
) -> None:
    assert "You are a helpful AI assistant named SmolLM" in render_chat(smollm2_template, [USER])
    assert "SmolLM" not in render_chat(smollm2_template, [SYSTEM, USER])
    assert render_chat(smollm2_template, [USER]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_feature_heavy_template_matches_transformers(
    with_tools: bool, enable_thinking: bool
) -> None:
    messages = [SYSTEM, USER, ASSISTANT, USER2]
    tools = TOOLS if with_tools else None
    ours = render_chat(
        TOOL_TEMPLATE,
        messages,
        tools=tools,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        enable_thinking=enable_thinking,
    )
    expected = _transformers_render(
        TOOL_TEMPLATE,
        messages,
        tools=tools,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )
    assert ours == expected


def test_tojson_does_not_html_escape_or_ascii_escape() -> None:
    out = render_chat("{{ tools | tojson }}", [], tools=[{"d": "<a> & “b” 你"}])
    assert out == '[{"d": "<a> & “b” 你"}]'


def test_raise_exception_surfaces_as_chat_template_error() -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('must start with user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="must start with user"):
        render_chat(template, [ASSISTANT])
    assert render_chat(template, [USER]) == ""


def test_sandbox_does_not_leak_python_internals() -> None:
    # An unsafe attribute is undefined (renders empty); going further through it is an error.
    assert render_chat("{{ ''.__class__ }}", []) == ""
    with pytest.raises(ChatTemplateError):
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])


def test_sandbox_forbids_mutating_inputs() -> None:
    messages = [dict(USER)]
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.append({'role': 'user'}) }}", messages)
    assert messages == [USER]


def test_namespace_rejects_underscore_attributes() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat("{% set ns = namespace(__x=1) %}{{ ns }}", [])


def test_syntax_error_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for m in messages %}{{ m }", [USER])


def test_type_error_in_template_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[0]['content'] + 1 }}", [USER])


def test_strftime_now_is_available() -> None:
    assert render_chat("{{ strftime_now('%Y') }}", []).isdigit()


def test_default_chatml_template_renders_chatml() -> None:
    out = render_chat(
        DEFAULT_CHATML_TEMPLATE, [SYSTEM, USER, {"role": "assistant", "content": None}]
    )
    assert out == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi! 你好 😀<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not render_chat(DEFAULT_CHATML_TEMPLATE, [USER], add_generation_prompt=False).endswith(
        "assistant\n"
    )
