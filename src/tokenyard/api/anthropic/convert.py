"""The Anthropic dialect's conversions: a messages request in; the message, its usage
and its stream events out.

Inbound: template messages (`system` first) and a `SamplingParams`, range errors named as
the client spelled them (`stop_sequences`). A final assistant message is a prefill: the
prepare stage (`text/prepare.py`) lets the model continue it. Outbound: Anthropic's usage
accounting (`input_tokens` are the prompt tokens *not* read from the cache), stop reasons,
the non-streamed message. The stream's events are built in `api/anthropic/stream.py`.

No I/O, no torch: the HTTP process calls these on its event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenyard.api.anthropic.schemas import (
    AnthropicMessage,
    AnthropicUsage,
    CountTokensRequest,
    MessagesRequest,
    StopReason,
    TextBlock,
)
from tokenyard.api.convert import random_id, sampling_params, stop_list
from tokenyard.text.prepare import TemplateMessage
from tokenyard.wire.outputs import Completion
from tokenyard.wire.sampling_params import SamplingParams


def new_message_id() -> str:
    """An id for an Anthropic message ("msg_…")."""
    return random_id("msg_")


# ---------------------------------------------------------------------------- requests in


def anthropic_messages(req: MessagesRequest | CountTokensRequest) -> list[TemplateMessage]:
    """Template messages of an Anthropic request, `system` first when present.

    A final assistant message is a prefill: the caller renders the template without a
    generation prompt and lets the model continue that text.
    """
    messages: list[TemplateMessage] = []
    system = req.system_text
    if system:
        messages.append({"role": "system", "content": system})
    messages.extend({"role": m.role, "content": m.text} for m in req.messages)
    return messages


def anthropic_request_to_engine(
    req: MessagesRequest,
) -> tuple[list[TemplateMessage], SamplingParams]:
    """Template messages (system included) and sampling parameters of a messages request."""
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": req.top_k or 0,
        "max_tokens": req.max_tokens,
        "stop": stop_list(req.stop_sequences),
        "ignore_eos": bool(req.ignore_eos),
    }
    params = sampling_params({"stop": "stop_sequences"}, **kwargs)
    return anthropic_messages(req), params


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
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def anthropic_usage(
    prompt_tokens: int, output_tokens: int, cached_tokens: int = 0
) -> AnthropicUsage:
    """Anthropic usage: `input_tokens` are the prompt tokens *not* read from the cache."""
    cached = min(cached_tokens, prompt_tokens)
    return AnthropicUsage(
        input_tokens=prompt_tokens - cached,
        output_tokens=output_tokens,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=cached,
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
) -> AnthropicMessage:
    """The non-streamed /v1/messages response for one finished completion."""
    stop_reason, stop_sequence = anthropic_stop_reason(
        completion.finish_reason or "stop", completion.stop_reason, stop_sequences
    )
    return AnthropicMessage(
        id=id,
        model=model,
        content=[TextBlock(text=completion.text)],
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=anthropic_usage(prompt_tokens, len(completion.token_ids), cached_tokens),
    )
