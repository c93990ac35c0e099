"""Prompts to token ids: text, token lists and conversations (through the chat template).

Torch-free on purpose: the HTTP process tokenizes here, and the engine's `Frontend`
re-exports these for its in-process callers.
"""

from __future__ import annotations

from typing import Any

from tokenyard.text.chat_template import DEFAULT_CHATML_TEMPLATE, render_chat
from tokenyard.text.tokenizer import Tokenizer

Conversation = list[dict[str, Any]]
Prompt = str | list[int] | Conversation


def render_conversation(
    tokenizer: Tokenizer, messages: Conversation, add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """A conversation as text through the model's chat template (ChatML if it has none);
    `tools`: function schemas for a template that renders them."""
    return render_chat(
        tokenizer.chat_template or DEFAULT_CHATML_TEMPLATE,
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "",
    )


def prompt_token_ids(
    tokenizer: Tokenizer, prompt: Prompt, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a text prompt, a token list, or a conversation (chat template).

    A rendered conversation is encoded without adding BOS: the template holds it already
    when the model wants one.
    """
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if prompt and isinstance(prompt[0], dict):
        return tokenizer.encode(
            render_conversation(tokenizer, prompt, add_generation_prompt),
            add_special_tokens=False,
        )
    return list(prompt)  # type: ignore[arg-type]
