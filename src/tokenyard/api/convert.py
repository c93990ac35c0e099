"""Pure conversions between the API bodies and the engine's values.

Inbound: an OpenAI chat / completions request or an Anthropic messages request becomes the
chat-template messages (or prompts) and a `SamplingParams`. Range errors from SamplingParams
come back as 400 `APIError`s naming the parameter the way the client spelled it
(`max_completion_tokens`, `stop_sequences`, ...).

Outbound: engine outputs (`Completion`, `CompletionDelta`, `Logprob`) become the OpenAI and
Anthropic response bodies and stream chunks, with usage (prompt, completion and cached
tokens). The stream builders are small stateful objects (they remember which choices have
started and where each choice's text offset is); everything else is a function.

No I/O, no torch: the HTTP process calls these on its event loop.
"""

from __future__ import annotations

import codecs
import math
import os
import random
import re
import secrets
import string
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenyard.api.schemas_anthropic import (
    AnthropicMessage,
    AnthropicUsage,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
)
from tokenyard.api.schemas_openai import (
    MAX_N,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FinishReason,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingFields,
    TextCompletion,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tokenyard.errors import INVALID_VALUE, APIError, invalid_request, unsupported
from tokenyard.wire.outputs import Completion, CompletionDelta, Logprob, RequestOutput
from tokenyard.wire.sampling_params import SamplingParams, SamplingParamsError

#: A chat-template message: {"role": ..., "content": ...}.
TemplateMessage = dict[str, str]
#: One prompt of a legacy completions request: text to tokenize, or token ids as given.
Prompt = str | list[int]
#: Raw bytes of a token id (`Tokenizer.id_to_token_bytes`), for logprobs' `token`/`bytes`.
TokenBytes = Callable[[int], bytes]

#: The logprob reported for a token the model gives no finite logprob (as OpenAI does).
MIN_LOGPROB = -9999.0

_ID_ALPHABET = string.ascii_letters + string.digits
_ID_RANDOM = random.Random(secrets.randbits(128))
# A forked worker must not draw the same ids as its parent.
os.register_at_fork(after_in_child=lambda: _ID_RANDOM.seed(secrets.randbits(128)))
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


# ---------------------------------------------------------------------------- ids and time


def random_id(prefix: str, length: int = 24) -> str:
    """`prefix` + `length` random base-62 characters."""
    # Response ids name a response, they guard nothing: a seeded PRNG draws all characters
    # in one call, where secrets.choice read the OS once per character.
    return prefix + "".join(_ID_RANDOM.choices(_ID_ALPHABET, k=length))


def new_chat_id() -> str:
    """An id for a chat completion ("chatcmpl-…")."""
    return random_id("chatcmpl-")


def new_completion_id() -> str:
    """An id for a legacy completion ("cmpl-…")."""
    return random_id("cmpl-")


def new_message_id() -> str:
    """An id for an Anthropic message ("msg_…")."""
    return random_id("msg_")


def now() -> int:
    """Unix time in whole seconds (the `created` field)."""
    return int(time.time())


# ---------------------------------------------------------------------------- requests in


def _sampling_params(renames: Mapping[str, str], **kwargs: Any) -> SamplingParams:
    """SamplingParams(**kwargs), its range errors as 400s under the client's parameter names."""
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        param = renames.get(exc.param, exc.param)
        message = str(exc)
        if param != exc.param:
            message = message.replace(exc.param, param)
        raise APIError(400, message, param=param, code=INVALID_VALUE) from None


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    return [s for s in stops if s]  # an empty stop string can never match: drop it


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


def _common_kwargs(req: SamplingFields, vocab_size: int | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "n": 1 if req.n is None else req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "logit_bias": _logit_bias(req.logit_bias, vocab_size),
        "seed": req.seed,
        "stop": _stop_list(req.stop),
        "min_tokens": req.min_tokens or 0,
    }
    return kwargs


def chat_request_to_engine(
    req: ChatCompletionRequest, vocab_size: int | None = None
) -> tuple[list[TemplateMessage], SamplingParams]:
    """Template messages and sampling parameters of a chat request.

    `developer` messages become `system` (chat templates know only the latter). `max_tokens`
    is None when the client set neither `max_completion_tokens` nor `max_tokens`: the caller
    fills in what the context window leaves. `vocab_size`, when given, bounds logit_bias ids.
    """
    messages: list[TemplateMessage] = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        for m in req.messages
    ]
    kwargs = _common_kwargs(req, vocab_size)
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
    return messages, _sampling_params(renames, **kwargs)


def completion_request_to_engine(
    req: CompletionRequest, vocab_size: int | None = None
) -> tuple[list[Prompt], SamplingParams]:
    """Prompts (texts to tokenize, or token ids as given) and sampling parameters.

    The response has `len(prompts) * n` choices; choice `i * n + j` is completion `j` of
    prompt `i`.
    """
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
    kwargs = _common_kwargs(req, vocab_size)
    n = kwargs["n"]
    if n * len(prompts) > MAX_N:
        raise invalid_request(
            f"'n' times the number of prompts must be at most {MAX_N}.", param="n",
            code=INVALID_VALUE,
        )
    if req.best_of is not None and req.best_of != n:
        if req.best_of < n:
            raise invalid_request(
                "'best_of' must be greater than or equal to 'n'.", param="best_of",
                code=INVALID_VALUE,
            )
        raise unsupported("best_of", "'best_of' greater than 'n' is not supported yet.")
    if req.echo and req.logprobs is not None:
        raise unsupported(
            "echo", "'echo' together with 'logprobs' is not supported yet (prompt logprobs "
            "are not computed).",
        )
    kwargs["max_tokens"] = req.max_tokens
    kwargs["logprobs"] = req.logprobs
    return prompts, _sampling_params({"top_logprobs": "logprobs"}, **kwargs)


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
        "stop": _stop_list(req.stop_sequences),
    }
    params = _sampling_params({"stop": "stop_sequences"}, **kwargs)
    return anthropic_messages(req), params


def has_prefill(messages: Sequence[TemplateMessage]) -> bool:
    """Whether the conversation ends with an assistant message to continue (Anthropic)."""
    return bool(messages) and messages[-1]["role"] == "assistant"


# ---------------------------------------------------------------------------- finish reasons


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


# ---------------------------------------------------------------------------- usage


def openai_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """OpenAI usage: `prompt_tokens` includes `cached_tokens`."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


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


# ---------------------------------------------------------------------------- logprobs


def token_string(raw: bytes) -> str:
    """A token's text for logprobs; a partial UTF-8 sequence is spelled "bytes:\\xe2\\x80"."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def chat_logprobs(entries: Sequence[Logprob], token_bytes: TokenBytes) -> ChoiceLogprobs:
    """`choices[].logprobs` of a chat completion for `entries` (one per generated token)."""
    content: list[TokenLogprob] = []
    for entry in entries:
        raw = token_bytes(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            alt = token_bytes(token_id)
            top.append(TopLogprob(token=token_string(alt), logprob=_finite(logprob),
                                  bytes=list(alt)))
        content.append(
            TokenLogprob(
                token=token_string(raw), logprob=_finite(entry.logprob), bytes=list(raw),
                top_logprobs=top,
            )
        )
    return ChoiceLogprobs(content=content)


class _OffsetCounter:
    """Character offsets of successive tokens' text (partial UTF-8 sequences count once)."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset where this token starts; moves past it."""
        at = self.offset
        self.offset += len(self._decoder.decode(raw))
        return at


def _completion_logprobs(
    entries: Sequence[Logprob], token_bytes: TokenBytes, offsets: _OffsetCounter
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for entry in entries:
        raw = token_bytes(entry.token_id)
        out.tokens.append(token_string(raw))
        out.token_logprobs.append(_finite(entry.logprob))
        out.top_logprobs.append(
            {token_string(token_bytes(t)): _finite(lp) for t, lp in entry.top}
        )
        out.text_offset.append(offsets.advance(raw))
    return out


def completion_logprobs(
    entries: Sequence[Logprob], token_bytes: TokenBytes, text_offset: int = 0
) -> CompletionLogprobs:
    """Legacy `choices[].logprobs`; offsets count characters from `text_offset`."""
    return _completion_logprobs(entries, token_bytes, _OffsetCounter(text_offset))


def _need_bytes(token_bytes: TokenBytes | None) -> TokenBytes:
    if token_bytes is None:
        raise ValueError("logprobs were computed but no token_bytes function was given")
    return token_bytes


# ---------------------------------------------------------------------------- OpenAI bodies


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
) -> ChatCompletion:
    """The non-streamed chat completion for finished `completions` (one per choice)."""
    choices = []
    for c in sorted(completions, key=lambda c: c.index):
        logprobs = None
        if c.logprobs is not None:
            logprobs = chat_logprobs(c.logprobs, _need_bytes(token_bytes))
        choices.append(
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                logprobs=logprobs,
                finish_reason=openai_finish_reason(c.finish_reason) or "stop",
            )
        )
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return ChatCompletion(
        id=id, created=created, model=model, system_fingerprint=system_fingerprint,
        choices=choices, usage=openai_usage(prompt_tokens, completion_tokens, cached_tokens),
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
) -> TextCompletion:
    """The non-streamed legacy completion.

    `completions[i]` are the `n` finished completions of prompt `i`; `prompt_tokens` and
    `cached_tokens` are totals over all prompts. With `echo_prompts`, each choice's text
    starts with its prompt's text.
    """
    choices = []
    for i, per_prompt in enumerate(completions):
        prefix = echo_prompts[i] if echo_prompts is not None else ""
        for c in sorted(per_prompt, key=lambda c: c.index):
            logprobs = None
            if c.logprobs is not None:
                logprobs = completion_logprobs(c.logprobs, _need_bytes(token_bytes), len(prefix))
            choices.append(
                CompletionChoice(
                    index=i * n + c.index,
                    text=prefix + c.text,
                    logprobs=logprobs,
                    finish_reason=legacy_finish_reason(c.finish_reason) or "stop",
                )
            )
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


@dataclass
class ChatStream:
    """Builds the chunks of one streamed chat completion.

    Per choice: a role chunk (``delta: {"role": "assistant", "content": ""}``), content
    chunks, then a finish chunk with an empty delta; after every choice, with include_usage,
    `usage_chunk` (``choices: []``). Each chunk carries one choice, as OpenAI's do.
    """

    id: str
    model: str
    created: int
    system_fingerprint: str | None = None
    token_bytes: TokenBytes | None = None
    _started: set[int] = field(default_factory=set)

    def _chunk(self, choice: ChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.system_fingerprint, choices=[choice],
        )

    def role_chunk(self, index: int = 0) -> ChatCompletionChunk:
        """The first chunk of choice `index`."""
        self._started.add(index)
        return self._chunk(
            ChunkChoice(index=index, delta=ChunkDelta(role="assistant", content=""))
        )

    def role_chunks(self, n: int) -> list[ChatCompletionChunk]:
        """Role chunks for choices 0..n-1 (send them before the first token arrives)."""
        return [self.role_chunk(i) for i in range(n) if i not in self._started]

    def delta_chunks(self, delta: CompletionDelta) -> list[ChatCompletionChunk]:
        """Chunks for one engine delta: role (if not yet sent), content, finish."""
        out: list[ChatCompletionChunk] = []
        if delta.index not in self._started:
            out.append(self.role_chunk(delta.index))
        logprobs = None
        if delta.logprobs:
            logprobs = chat_logprobs(delta.logprobs, _need_bytes(self.token_bytes))
        if delta.text or logprobs is not None:
            out.append(self._chunk(ChunkChoice(
                index=delta.index, delta=ChunkDelta(content=delta.text), logprobs=logprobs,
            )))
        finish = openai_finish_reason(delta.finish_reason)
        if finish is not None:
            out.append(self._chunk(
                ChunkChoice(index=delta.index, delta=ChunkDelta(), finish_reason=finish)
            ))
        return out

    def output_chunks(self, output: RequestOutput) -> list[ChatCompletionChunk]:
        """Chunks for every delta of one engine step's output."""
        return [chunk for d in output.deltas for chunk in self.delta_chunks(d)]

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> ChatCompletionChunk:
        """The final usage chunk (`choices` is empty)."""
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.system_fingerprint, choices=[],
            usage=openai_usage(prompt_tokens, completion_tokens, cached_tokens),
        )


@dataclass
class CompletionStream:
    """Builds the chunks of one streamed legacy completion (object "text_completion").

    Choice index is ``prompt_index * n + delta.index``; the finish reason rides on the
    delta's own chunk, as the legacy API does.
    """

    id: str
    model: str
    created: int
    n: int = 1
    system_fingerprint: str | None = None
    token_bytes: TokenBytes | None = None
    _offsets: dict[int, _OffsetCounter] = field(default_factory=dict)

    def _chunk(self, choice: CompletionChoice) -> TextCompletion:
        return TextCompletion(
            id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.system_fingerprint, choices=[choice],
        )

    def echo_chunks(self, prompt_index: int, prompt_text: str) -> list[TextCompletion]:
        """With `echo`: the prompt's text as the first chunk of each of its `n` choices."""
        out = []
        for j in range(self.n):
            index = prompt_index * self.n + j
            self._offsets[index] = _OffsetCounter(len(prompt_text))
            out.append(self._chunk(CompletionChoice(index=index, text=prompt_text)))
        return out

    def delta_chunks(self, delta: CompletionDelta, prompt_index: int = 0) -> list[TextCompletion]:
        """The chunk for one engine delta of prompt `prompt_index` (none if nothing new)."""
        index = prompt_index * self.n + delta.index
        logprobs = None
        if delta.logprobs:
            offsets = self._offsets.setdefault(index, _OffsetCounter())
            logprobs = _completion_logprobs(delta.logprobs, _need_bytes(self.token_bytes),
                                            offsets)
        finish = legacy_finish_reason(delta.finish_reason)
        if not delta.text and logprobs is None and finish is None:
            return []
        return [self._chunk(CompletionChoice(
            index=index, text=delta.text, logprobs=logprobs, finish_reason=finish,
        ))]

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> TextCompletion:
        """The final usage chunk (`choices` is empty)."""
        return TextCompletion(
            id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.system_fingerprint, choices=[],
            usage=openai_usage(prompt_tokens, completion_tokens, cached_tokens),
        )


# ---------------------------------------------------------------------------- Anthropic bodies


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


@dataclass
class AnthropicStream:
    """Builds the events of one streamed /v1/messages response.

    `start_events` → message_start, content_block_start, ping; `delta_events` for each engine
    delta → content_block_delta (text_delta), and on the finishing delta content_block_stop,
    message_delta (stop reason, cumulative usage) and message_stop. Send each event with
    `sse.anthropic_event`, whose SSE event name is the payload's `type`.
    """

    id: str
    model: str
    stop_sequences: Sequence[str] = ()
    _block_open: bool = False

    def message_start(self, prompt_tokens: int, cached_tokens: int = 0) -> MessageStartEvent:
        """message_start: the message with no content yet and the input usage."""
        return MessageStartEvent(message=AnthropicMessage(
            id=self.id, model=self.model, content=[],
            usage=anthropic_usage(prompt_tokens, 0, cached_tokens),
        ))

    def content_block_start(self) -> ContentBlockStartEvent:
        """Opens the text block (index 0)."""
        self._block_open = True
        return ContentBlockStartEvent()

    def start_events(self, prompt_tokens: int, cached_tokens: int = 0) -> list[StreamEvent]:
        """message_start, content_block_start, ping."""
        return [
            self.message_start(prompt_tokens, cached_tokens),
            self.content_block_start(),
            PingEvent(),
        ]

    def text_delta(self, text: str) -> ContentBlockDeltaEvent:
        """content_block_delta with a text_delta."""
        return ContentBlockDeltaEvent(delta=TextDelta(text=text))

    def finish_events(
        self,
        finish_reason: str | None,
        stop_reason: int | str | None,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int = 0,
    ) -> list[StreamEvent]:
        """content_block_stop (if a block is open), message_delta, message_stop."""
        reason, sequence = anthropic_stop_reason(
            finish_reason or "stop", stop_reason, self.stop_sequences
        )
        usage = anthropic_usage(prompt_tokens, output_tokens, cached_tokens)
        events: list[StreamEvent] = []
        if self._block_open:
            self._block_open = False
            events.append(ContentBlockStopEvent())
        events.append(MessageDeltaEvent(
            delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
            usage=MessageDeltaUsage(
                input_tokens=usage.input_tokens,
                output_tokens=output_tokens,
                cache_creation_input_tokens=usage.cache_creation_input_tokens,
                cache_read_input_tokens=usage.cache_read_input_tokens,
            ),
        ))
        events.append(MessageStopEvent())
        return events

    def delta_events(
        self,
        delta: CompletionDelta,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int = 0,
    ) -> list[StreamEvent]:
        """Events for one engine delta; the usage figures are the request's running totals."""
        events: list[StreamEvent] = []
        if delta.text:
            if not self._block_open:
                events.append(self.content_block_start())
            events.append(self.text_delta(delta.text))
        if delta.finish_reason is not None:
            events.extend(self.finish_events(
                delta.finish_reason, delta.stop_reason, prompt_tokens, output_tokens,
                cached_tokens,
            ))
        return events

    def output_events(self, output: RequestOutput) -> list[StreamEvent]:
        """Events for one engine step's output (n is 1 on this API)."""
        return [
            event
            for d in output.deltas
            for event in self.delta_events(
                d, output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens
            )
        ]
