"""The OpenAI dialect's conversions: requests in, response bodies out.

Inbound: a chat or legacy completions request becomes template messages (or prompts) and a
`SamplingParams`; range errors come back as 400s naming the parameter the way the client
spelled it (`max_completion_tokens`, ...). Outbound: finished `Completion`s become the
non-streamed bodies, with usage (prompt, completion and cached tokens), finish reasons and
logprobs in OpenAI's shapes. The stream chunks are built in `api/openai/stream.py`.

No I/O, no torch: the HTTP process calls these on its event loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

from tokenyard.api.convert import random_id, sampling_params, stop_list
from tokenyard.api.images import template_message
from tokenyard.api.openai.completion_fields import (
    echo_only,
    engine_logprobs,
    engine_n,
    refuse_suffix,
)
from tokenyard.api.openai.legacy_logprobs import (
    TokenBytes,
    choice_logprobs,
    finite,
    token_string,
)
from tokenyard.api.openai.schemas import (
    MAX_N,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionTokensDetails,
    CompletionUsage,
    FinishReason,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingFields,
    TextCompletion,
    TokenLogprob,
    TopLogprob,
)
from tokenyard.api.openai.tool_schemas import ResponseFormatJSONObject, ResponseFormatJSONSchema
from tokenyard.api.openai.tools import assistant_message
from tokenyard.errors import INVALID_VALUE, invalid_request
from tokenyard.sampling_defaults import NONE, PARAMETERS, SamplingDefaults
from tokenyard.text.prepare import TemplateMessage
from tokenyard.text.reasoning import split_completion
from tokenyard.text.tools import ToolUse
from tokenyard.wire.outputs import Completion, Logprob
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams, SamplingParamsError

#: One prompt of a legacy completions request: text to tokenize, or token ids as given.
Prompt = str | list[int]

_TOKEN_ID = re.compile(r"[0-9]{1,10}")


# ---------------------------------------------------------------------------- ids


def new_chat_id() -> str:
    """An id for a chat completion ("chatcmpl-…")."""
    return random_id("chatcmpl-")


def new_completion_id() -> str:
    """An id for a legacy completion ("cmpl-…")."""
    return random_id("cmpl-")


# ---------------------------------------------------------------------------- requests in


def _logit_bias(
    bias: dict[str, float] | None, vocab_size: int | None
) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise invalid_request(
                f"Invalid 'logit_bias': key {key!r} is not a token id.",
                param="logit_bias", code=INVALID_VALUE,
            )
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise invalid_request(
                f"Invalid 'logit_bias': token id {token} is outside the vocabulary "
                f"(size {vocab_size}).",
                param="logit_bias", code=INVALID_VALUE,
            )
        out[token] = value
    return out


def _common_kwargs(req: SamplingFields, vocab_size: int | None,
                   defaults: SamplingDefaults) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "n": 1 if req.n is None else req.n,
        **{name: defaults.value(name, getattr(req, name)) for name in PARAMETERS},
        "logit_bias": _logit_bias(req.logit_bias, vocab_size),
        "seed": req.seed,
        "stop": stop_list(req.stop),
        "min_tokens": req.min_tokens or 0,
        "ignore_eos": bool(req.ignore_eos),
        "skip_special_tokens": req.skip_special_tokens is not False,
        "guided": guided_decoding(req),
    }
    return kwargs


def guided_decoding(req: SamplingFields) -> GuidedDecoding | None:
    """The grammar `response_format` (or one of vLLM's `guided_*` fields) asks for.

    `json_object` is any JSON object; `json_schema` forces its schema whether `strict` is
    true or not (the output always parses and validates); no schema is any JSON object.
    An invalid or unsupported schema is found by the replica, which answers 400 naming
    ``response_format.json_schema.schema`` (or the guided_* field).
    """
    fmt = req.response_format
    asked: list[tuple[str, str, str]] = []  # (field, grammar kind, spec)
    if isinstance(fmt, ResponseFormatJSONObject):
        asked.append(("response_format", "json_object", ""))
    elif isinstance(fmt, ResponseFormatJSONSchema):
        schema = fmt.json_schema.schema_
        asked.append(("response_format.json_schema.schema", *(
            ("json_object", "") if schema is None else ("json_schema", json.dumps(schema)))))
    if req.guided_json is not None:
        spec = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        asked.append(("guided_json", "json_schema", spec))
    if req.guided_regex is not None:
        asked.append(("guided_regex", "regex", req.guided_regex))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", "ebnf", req.guided_grammar))
    if req.guided_choice is not None:
        choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in req.guided_choice)
        asked.append(("guided_choice", "ebnf", f"root ::= {choices}"))
    if len(asked) > 1:
        first, second = (field.split(".")[0] for field, _, _ in asked[:2])
        raise invalid_request(f"'{first}' and '{second}' cannot be used together.",
                              param=second, code=INVALID_VALUE)
    if not asked:
        return None
    field, kind, spec = asked[0]
    try:
        return GuidedDecoding(kind, spec, param=field)
    except SamplingParamsError as exc:  # an empty regex or grammar
        raise invalid_request(str(exc), param=exc.param, code=INVALID_VALUE) from None


def chat_request_to_engine(
    req: ChatCompletionRequest, vocab_size: int | None = None,
    defaults: SamplingDefaults = NONE,
) -> tuple[list[TemplateMessage], SamplingParams]:
    """Template messages and sampling parameters of a chat request.

    `developer` messages become `system` (chat templates know only the latter); a message
    with image parts keeps them, in order, under `parts` (loaded later, for a vision
    deployment only). `max_tokens` is None when the client set neither
    `max_completion_tokens` nor `max_tokens`: the caller fills in what the context window
    leaves. `vocab_size`, when given, bounds logit_bias ids; `defaults` are the deployment's
    sampling defaults for what the request leaves out.
    """
    messages = [
        template_message("system" if m.role == "developer" else m.role, m.text, m.content,
                         f"messages.{i}")
        for i, m in enumerate(req.messages)
    ]
    kwargs = _common_kwargs(req, vocab_size, defaults)
    renames: dict[str, str] = {}
    if req.max_completion_tokens is not None:
        kwargs["max_tokens"] = req.max_completion_tokens
        renames["max_tokens"] = "max_completion_tokens"
    else:
        kwargs["max_tokens"] = req.max_tokens
    if req.top_logprobs and not req.logprobs:
        raise invalid_request(
            "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs",
            code=INVALID_VALUE,
        )
    kwargs["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    return messages, sampling_params(renames, **kwargs)


def completion_request_to_engine(
    req: CompletionRequest, vocab_size: int | None = None,
    defaults: SamplingDefaults = NONE,
) -> tuple[list[Prompt], SamplingParams]:
    """Prompts (texts to tokenize, or token ids as given) and sampling parameters.

    The response has `len(prompts) * n` choices; choice `i * n + j` is completion `j` of
    prompt `i`.
    """
    refuse_suffix(req, req.model)
    raw = req.prompt
    prompts: list[Prompt]
    if isinstance(raw, str):
        prompts = [raw]
    elif all(isinstance(p, int) for p in raw):
        prompts = [[int(p) for p in raw if isinstance(p, int)]]
    else:
        prompts = [p if isinstance(p, str) else list(p) for p in raw if not isinstance(p, int)]
    for p in prompts:
        if isinstance(p, list):
            bad = [t for t in p if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise invalid_request(
                    f"Invalid 'prompt': token id {bad[0]} is outside the vocabulary.",
                    param="prompt", code=INVALID_VALUE,
                )
    kwargs = _common_kwargs(req, vocab_size, defaults)
    n = kwargs["n"]
    if n * len(prompts) > MAX_N:
        raise invalid_request(
            f"'n' times the number of prompts must be at most {MAX_N}.", param="n",
            code=INVALID_VALUE,
        )
    kwargs["n"] = engine_n(req, n, len(prompts))  # best_of, when it is more
    if req.echo and (req.logprobs is not None or echo_only(req)):
        # The echoed prompt's tokens are scored (max_tokens 0 asks the engine for that alone).
        kwargs["prompt_logprobs"] = req.logprobs or 0
    kwargs["max_tokens"] = req.max_tokens
    kwargs["logprobs"] = engine_logprobs(req, n)
    return prompts, sampling_params({"top_logprobs": "logprobs"}, **kwargs)


# ---------------------------------------------------------------------------- finish and usage


def openai_finish_reason(finish_reason: str | None) -> FinishReason | None:
    """Engine finish reason → OpenAI's ("length" stays, EOS/stop strings/abort → "stop")."""
    if finish_reason is None:
        return None
    if finish_reason in ("length", "content_filter", "tool_calls"):
        return finish_reason  # type: ignore[return-value]
    return "stop"


def legacy_finish_reason(
    finish_reason: str | None,
) -> Literal["stop", "length", "content_filter"] | None:
    """Engine finish reason → the legacy completions' set."""
    if finish_reason is None:
        return None
    if finish_reason in ("length", "content_filter"):
        return finish_reason  # type: ignore[return-value]
    return "stop"


def openai_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                 reasoning_tokens: int = 0) -> CompletionUsage:
    """OpenAI usage: `prompt_tokens` includes `cached_tokens`, `completion_tokens` the
    `reasoning_tokens`."""
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
    )


# ---------------------------------------------------------------------------- logprobs


def chat_logprobs(entries: Sequence[Logprob], token_bytes: TokenBytes) -> ChoiceLogprobs:
    """`choices[].logprobs` of a chat completion for `entries` (one per generated token)."""
    content: list[TokenLogprob] = []
    for entry in entries:
        raw = token_bytes(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            alt = token_bytes(token_id)
            top.append(TopLogprob(token=token_string(alt), logprob=finite(logprob),
                                  bytes=list(alt)))
        content.append(
            TokenLogprob(
                token=token_string(raw), logprob=finite(entry.logprob), bytes=list(raw),
                top_logprobs=top,
            )
        )
    return ChoiceLogprobs(content=content)


def no_bytes(token_id: int) -> bytes:
    """A TokenBytes for no tokenizer: every token's bytes are none."""
    return b""


def need_bytes(token_bytes: TokenBytes | None) -> TokenBytes:
    if token_bytes is None:
        raise ValueError("logprobs were computed but no token_bytes function was given")
    return token_bytes


# ---------------------------------------------------------------------------- bodies


def build_chat_completion(
    *,
    id: str,
    model: str,
    created: int,
    completions: Sequence[Completion],
    prompt_tokens: int,
    cached_tokens: int = 0,
    token_bytes: TokenBytes | None = None,
    system_fingerprint: str | None = None,
    completion_tokens: int | None = None,
    tools: ToolUse | None = None,
    reasoning: tuple[str, bool] | None = None,
) -> ChatCompletion:
    """The non-streamed chat completion for finished `completions` (one per choice);
    `completion_tokens` defaults to their token ids' count; with active `tools`, each
    choice's calls are split out of its text; with a `reasoning` parser, its thinking
    goes to `reasoning_content` and its tokens to `reasoning_tokens`."""
    choices = []
    reasoning_tokens = 0
    for c in sorted(completions, key=lambda c: c.index):
        logprobs = None
        if c.logprobs is not None:
            logprobs = chat_logprobs(c.logprobs, need_bytes(token_bytes))
        thought = None
        if reasoning is not None:
            thought, answer, tokens = split_completion(c.text, c.token_ids,
                                                       token_bytes or no_bytes, reasoning)
            reasoning_tokens += tokens
            c = replace(c, text=answer)
        message, finish = assistant_message(
            c, tools, openai_finish_reason(c.finish_reason) or "stop")
        if thought:
            message.reasoning_content = thought
        choices.append(
            ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish)
        )
    if completion_tokens is None:
        completion_tokens = sum(len(c.token_ids) for c in completions)
    return ChatCompletion(
        id=id, created=created, model=model, system_fingerprint=system_fingerprint,
        choices=choices,
        usage=openai_usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens),
    )


def build_text_completion(
    *,
    id: str,
    model: str,
    created: int,
    completions: Sequence[Sequence[Completion]],
    n: int,
    prompt_tokens: int,
    cached_tokens: int = 0,
    token_bytes: TokenBytes | None = None,
    echo_prompts: Sequence[str] | None = None,
    system_fingerprint: str | None = None,
    completion_tokens: int | None = None,
) -> TextCompletion:
    """The non-streamed legacy completion.

    `completions[i]` are the `n` finished completions of prompt `i`; `prompt_tokens` and
    `cached_tokens` are totals over all prompts. With `echo_prompts`, each choice's text
    starts with its prompt's text (and its logprobs with the prompt's, when scored).
    """
    choices = []
    for i, per_prompt in enumerate(completions):
        echo = echo_prompts[i] if echo_prompts is not None else None
        prefix = echo or ""
        for c in sorted(per_prompt, key=lambda c: c.index):
            logprobs = None
            if c.logprobs is not None or (echo is not None and c.prompt_logprobs is not None):
                logprobs = choice_logprobs(c, need_bytes(token_bytes), echo)
            choices.append(
                CompletionChoice(
                    index=i * n + c.index,
                    text=prefix + c.text,
                    logprobs=logprobs,
                    finish_reason=legacy_finish_reason(c.finish_reason) or "stop",
                )
            )
    if completion_tokens is None:
        completion_tokens = sum(len(c.token_ids) for per in completions for c in per)
    return TextCompletion(
        id=id, created=created, model=model, system_fingerprint=system_fingerprint,
        choices=choices, usage=openai_usage(prompt_tokens, completion_tokens, cached_tokens),
    )


def build_model_list(models: Sequence[tuple[str, int, str]]) -> ModelList:
    """GET /v1/models from (id, created, owned_by) triples."""
    return ModelList(
        data=[ModelCard(id=mid, created=created, owned_by=owner) for mid, created, owner in models]
    )
