"""The Anthropic dialect's conversions: a messages request in; the message, its usage
and its stream events out.

Inbound: template messages (`system` first) and a `SamplingParams` (with the grammar of
`output_config.format`), range errors named as the client spelled them (`stop_sequences`).
A final assistant message is a prefill: the prepare stage (`text/prepare.py`) lets the
model continue it. Outbound: Anthropic's usage accounting (`input_tokens` are the prompt
tokens *not* read from the cache), stop reasons, the non-streamed message. The stream's
events are built in `api/anthropic/stream.py`.

No I/O, no torch: the HTTP process calls these on its event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from tokenyard.api.anthropic.schemas import (
    AnthropicMessage,
    AnthropicUsage,
    CacheCreation,
    CountTokensRequest,
    MessagesRequest,
    OutputTokensDetails,
    StopReason,
    ThinkingBlock,
    blocks_text,
)
from tokenyard.api.anthropic.tools import content_blocks
from tokenyard.api.convert import random_id, sampling_params, stop_list
from tokenyard.api.images import template_message
from tokenyard.sampling_defaults import NONE, SamplingDefaults
from tokenyard.text.prepare import Preparer, TemplateMessage
from tokenyard.text.reasoning import split_completion
from tokenyard.text.tools import ToolUse
from tokenyard.wire.outputs import Completion
from tokenyard.wire.protocol import Pin
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams


def new_message_id() -> str:
    """An id for an Anthropic message ("msg_…")."""
    return random_id("msg_")


# ---------------------------------------------------------------------------- requests in


def anthropic_messages(req: MessagesRequest | CountTokensRequest) -> list[TemplateMessage]:
    """Template messages of an Anthropic request, `system` first when present.

    A final assistant message is a prefill: the caller renders the template without a
    generation prompt and lets the model continue that text. Image blocks stay, in order,
    under `parts` (loaded later, for a vision deployment only).
    """
    messages: list[TemplateMessage] = []
    system = req.system_text
    if system:
        messages.append({"role": "system", "content": system})
    messages.extend(template_message(m.role, m.text, m.content, f"messages.{i}")
                    for i, m in enumerate(req.messages))
    return messages


def anthropic_request_to_engine(
    req: MessagesRequest, defaults: SamplingDefaults = NONE,
) -> tuple[list[TemplateMessage], SamplingParams]:
    """Template messages (system included) and sampling parameters of a messages request
    (`defaults`: the deployment's, for the sampling parameters it leaves out)."""
    kwargs: dict[str, Any] = {
        "n": 1,
        **{name: defaults.value(name, getattr(req, name))
           for name in ("temperature", "top_p", "top_k")},
        "max_tokens": req.max_tokens,
        "stop": stop_list(req.stop_sequences),
        "ignore_eos": bool(req.ignore_eos),
        "guided": output_guided(req),
    }
    params = sampling_params({"stop": "stop_sequences"}, **kwargs)
    return anthropic_messages(req), params


def output_guided(req: MessagesRequest) -> GuidedDecoding | None:
    """The grammar `output_config.format` (or the beta `output_format`) asks for: the
    reply is one JSON value valid against the schema, as with OpenAI's `response_format`
    json_schema. An invalid or unsupported schema is found by the replica, which answers
    400 naming the field."""
    asked = req.output_schema
    if asked is None:
        return None
    field, schema = asked
    return GuidedDecoding("json_schema", json.dumps(schema), param=field)


def cache_prefixes(req: MessagesRequest) -> list[tuple[list[TemplateMessage], float]]:
    """Each `cache_control` breakpoint as the conversation cut just after its block (for
    the prepare stage to measure in tokens), with its TTL in seconds."""
    full = anthropic_messages(req)
    first = 1 if req.system_text else 0  # where req.messages begin in `full`
    prefixes: list[tuple[list[TemplateMessage], float]] = []
    for index, block, ttl in req.cache_breakpoints():
        role, content = (("system", req.system) if index is None
                         else (req.messages[index].role, req.messages[index].content))
        # A string content has a breakpoint only from the top-level cache_control.
        text = content if isinstance(content, str) else blocks_text((content or [])[:block + 1])
        cut: TemplateMessage = {"role": role, "content": text}
        head = [] if index is None else full[:first + index]
        prefixes.append(([*head, cut], ttl))
    return prefixes


def cache_pins(
    prepare: Preparer, req: MessagesRequest, prompt: Sequence[int], block_size: int | None
) -> list[Pin]:
    """The replica pins of a request's breakpoints: each one's prefix of `prompt` in
    tokens, rounded down to whole KV blocks of `block_size` (what a replica can keep) and
    short of the prompt's last token (which is always computed, never read). Empty for
    a deployment without a prompt cache (`block_size` None: an upstream)."""
    if block_size is None:
        return []
    pins: list[Pin] = []
    for messages, ttl in cache_prefixes(req):
        covered = min(prepare.prefix_length(messages, prompt), len(prompt) - 1)
        if covered >= block_size:
            pins.append((covered // block_size * block_size, ttl))
    return pins


# ---------------------------------------------------------------------------- stop and usage


def anthropic_stop_reason(
    finish_reason: str | None,
    stop_reason: int | str | None,
    stop_sequences: Sequence[str] = (),
) -> tuple[StopReason | None, str | None]:
    """(stop_reason, stop_sequence) as Anthropic reports them.

    "length" → max_tokens; a matched string from the request's `stop_sequences` →
    stop_sequence with that string; anything else (EOS, a stop token, abort) → end_turn.
    """
    if finish_reason is None:
        return None, None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":  # output moderation stopped it
        return "refusal", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def anthropic_usage(
    prompt_tokens: int, output_tokens: int, cached_tokens: int = 0,
    cache_writes: tuple[int, int] | None = None, thinking_tokens: int = 0,
) -> AnthropicUsage:
    """Anthropic usage: `cache_read_input_tokens` are the prompt tokens read from the
    cache, `cache_creation_input_tokens` those the request's breakpoints wrote to it
    (`cache_writes`: kept 5 minutes, kept 1 hour; None without breakpoints) and
    `input_tokens` the rest."""
    cached = min(cached_tokens, prompt_tokens)
    written_5m, written_1h = cache_writes or (0, 0)
    written = min(written_5m + written_1h, prompt_tokens - cached)
    return AnthropicUsage(
        input_tokens=prompt_tokens - cached - written,
        output_tokens=output_tokens,
        cache_creation_input_tokens=written,
        cache_read_input_tokens=cached,
        cache_creation=CacheCreation(ephemeral_5m_input_tokens=written_5m,
                                     ephemeral_1h_input_tokens=written_1h),
        output_tokens_details=OutputTokensDetails(thinking_tokens=thinking_tokens),
    )


# ---------------------------------------------------------------------------- responses out


def build_anthropic_message(
    *,
    id: str,
    model: str,
    completion: Completion,
    prompt_tokens: int,
    cached_tokens: int = 0,
    stop_sequences: Sequence[str] = (),
    output_tokens: int | None = None,
    cache_writes: tuple[int, int] | None = None,
    tools: ToolUse | None = None,
    reasoning: tuple[str, bool] | None = None,
    token_bytes: Callable[[int], bytes] | None = None,
) -> AnthropicMessage:
    """The non-streamed /v1/messages response for one finished completion;
    `output_tokens` defaults to its token ids' count; `cache_writes` as in
    `anthropic_usage`; with active `tools`, its calls as tool_use blocks; with a
    `reasoning` parser, its thinking as a thinking block first."""
    stop_reason, stop_sequence = anthropic_stop_reason(
        completion.finish_reason or "stop", completion.stop_reason, stop_sequences
    )
    text, thought, thinking_tokens = completion.text, "", 0
    if reasoning is not None:
        thought, text, thinking_tokens = split_completion(
            text, completion.token_ids, token_bytes or (lambda _: b""), reasoning)
    content, called = content_blocks(text, tools)
    if thought:
        content.insert(0, ThinkingBlock(thinking=thought))
    if called and stop_reason == "end_turn":
        stop_reason = "tool_use"
    return AnthropicMessage(
        id=id,
        model=model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=anthropic_usage(prompt_tokens, len(completion.token_ids)
                              if output_tokens is None else output_tokens, cached_tokens,
                              cache_writes, thinking_tokens),
    )
