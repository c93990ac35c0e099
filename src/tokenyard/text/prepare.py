"""The prepare stage (DESIGN §1, stage 10): a conversation through the model's chat
template, tokenized once, and its generation fitted into the context window.

Plain values in and out, no HTTP: the routes of either dialect call it with the template
messages their conversion produced and get token ids back, or an `APIError` to render.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from tokenyard.deployments import DEFAULT_MAX_TOOL_CALLS
from tokenyard.errors import APIError, context_length_exceeded
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.chat_template import ChatTemplateError
from tokenyard.text.content import TemplateMessage
from tokenyard.text.prompts import Conversation, render_conversation
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.text.tool_grammar import constrained
from tokenyard.text.tools import ToolUse, continues_results
from tokenyard.wire.sampling_params import SamplingParams


def has_prefill(messages: Sequence[TemplateMessage]) -> bool:
    """Whether the conversation ends with an assistant message to continue."""
    return bool(messages) and messages[-1]["role"] == "assistant"


def fit(
    prompt_len: int, params: SamplingParams, param: str, max_model_len: int,
    max_output_tokens: int | None = None,
) -> SamplingParams:
    """Check prompt + max_tokens against the window and the deployment's output cap
    `max_output_tokens` (None: the window alone); fill max_tokens when unset with the
    rest of the window, at most the cap — the window alone let a request at temperature
    1 run for minutes. More than the cap is refused, as OpenAI refuses more than a
    model's output limit (not clamped: the client would get less than it asked for
    without being told).

    `param` names the request parameter a refusal points at."""
    if params.max_tokens is None:
        left = max_model_len - prompt_len
        if left < 1:
            raise context_length_exceeded(max_model_len, prompt_len, None, param=param)
        return replace(params, max_tokens=min(left, max_output_tokens or left))
    if prompt_len + params.max_tokens > max_model_len:  # the window first: the usual code
        raise context_length_exceeded(max_model_len, prompt_len, params.max_tokens,
                                      param=param)
    if max_output_tokens is not None and params.max_tokens > max_output_tokens:
        # A route points a window refusal at the prompt ("messages") when the length
        # came from chat's max_tokens; this refusal is about the length's own field.
        name = param if param.startswith("max_") else "max_tokens"
        raise APIError(400, f"{name} is too large: {params.max_tokens}. This model "
                       f"supports at most {max_output_tokens} output tokens per request; "
                       f"set {name} to {max_output_tokens} or less.", param=name,
                       code="invalid_value")
    return params


@dataclass(frozen=True)
class Preparer:
    """The prepare stage over one model's tokenizer and context window."""

    tokenizer: Tokenizer
    max_model_len: int
    #: The deployment's output cap (`fit`); None: the window alone.
    max_output_tokens: int | None = None
    #: The deployment's cap on tool calls per response (`constrained`); None: unbounded.
    max_tool_calls: int | None = DEFAULT_MAX_TOOL_CALLS

    def template(self, messages: Sequence[TemplateMessage], add_generation_prompt: bool,
                 tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation through the model's chat template, as text (`tools` for a
        template that renders them, `text/tools.py`). A model without a template of its
        own (a base model) has no chat format to guess: refused, as vLLM does."""
        if self.tokenizer.chat_template is None:
            raise APIError(400, "This model has no chat template (it is a base model, not "
                           "tuned for conversations); send a prompt to /v1/completions "
                           "instead.", param="model")
        try:
            return render_conversation(
                self.tokenizer, cast(Conversation, list(messages)), add_generation_prompt,
                tools,
            )
        except ChatTemplateError as exc:
            raise APIError(400, f"The chat template rejected the messages: {exc}",
                           param="messages") from None

    def template_with_prefill(self, messages: Sequence[TemplateMessage],
                              tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as text, a final assistant message being the start of the reply.

        The template renders the turns before it with the generation prompt, and the
        prefill text follows raw — rendering it as a finished turn would close it with the
        end-of-turn token and the model would start a new turn instead of continuing.
        """
        if not has_prefill(messages):
            return self.template(messages, True, tools)
        return self.template(messages[:-1], True, tools) + messages[-1]["content"]

    def encode_rendered(self, text: str) -> list[int]:
        """Tokens of templated text (the template already holds BOS if the model wants it)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prefix_length(self, messages: Sequence[TemplateMessage], prompt: Sequence[int]) -> int:
        """How many of `prompt`'s tokens the conversation `messages` (a truncation of the
        one `prompt` was made of) renders to: its templated tokens' longest common prefix
        with `prompt`. The template closes the last turn, and a token can merge across
        the cut: only what truly prefixes `prompt` counts. 0 if the template refuses it."""
        try:
            ids = self.encode_rendered(self.template(messages, add_generation_prompt=False))
        except APIError:
            return 0
        n = 0
        for a, b in zip(ids, prompt, strict=False):
            if a != b:
                break
            n += 1
        return n

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Tokens of a raw completions prompt (BOS added as the model wants); token ids
        pass through as given."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return prompt

    def conversation(
        self, messages: Sequence[TemplateMessage], timeline: Timeline, *, prefill: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a conversation: templated (with the prefill rule when `prefill`,
        or when tool results continue the last assistant turn, `continues_results`;
        `tools` for a template that renders them), then tokenized; `timeline` gets the
        "templated" and "tokenized" marks."""
        text = (self.template_with_prefill(messages, tools)
                if prefill or continues_results(messages)
                else self.template(messages, True, tools))
        timeline.mark("templated")
        ids = self.encode_rendered(text)
        timeline.mark("tokenized")
        return ids

    def fit(self, prompt_len: int, params: SamplingParams, param: str) -> SamplingParams:
        """`fit` against this model's context window and the deployment's output cap."""
        return fit(prompt_len, params, param, self.max_model_len, self.max_output_tokens)

    def constrained(self, params: SamplingParams, use: ToolUse | None) -> SamplingParams:
        """`tool_grammar.constrained` under the deployment's cap on calls per response."""
        return constrained(params, use, self.max_tool_calls)
