"""Bodies of the OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Requests are validated strictly for types (a string where a number belongs is a 400, not a
silent coercion); an unknown top-level field is a 400 naming it, as OpenAI answers.
Documented fields without effect here are accepted, and the ones this server does not
implement (`functions`, audio, audio/file content parts, ...) are 400s naming them
(`api.openai.platform_fields`), never dropped silently. Value ranges are checked once, by
`SamplingParams`, when `api.openai.convert` builds the engine's parameters, so the range
rules live in one place.

Responses mirror OpenAI's field names and nesting exactly, so the official SDK parses them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer, model_validator

from tokenyard.api.errors import schema_error
from tokenyard.api.images import only_from_user
from tokenyard.api.openai.content_parts import ContentPartParam, join_text
from tokenyard.api.openai.platform_fields import (
    CHAT_UNSUPPORTED,
    SERVICE_TIER,
    ChatHints,
    PlatformFields,
    ServiceTier,
)
from tokenyard.api.openai.tool_schemas import (
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
    ToolCallDelta,
    ToolCallParam,
    ToolParam,
)
from tokenyard.api.schemas import (
    Acceptable,
    ModelName,
    RequestModel,
    StopString,
    reject_unknown,
    reject_unsupported,
)
from tokenyard.errors import INVALID_VALUE, UNSUPPORTED_PARAMETER

#: Upper bound on `n` (choices per prompt), as OpenAI's own limit.
MAX_N = 128
#: Upper bound on the legacy completions `logprobs` (the engine computes at most 20).
MAX_COMPLETION_LOGPROBS = 20


# ---------------------------------------------------------------------------- chat request

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(RequestModel):
    """One message of `messages`: role plus content as a string or an array of text parts."""

    role: ChatRole
    content: str | list[ContentPartParam] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise schema_error(
                INVALID_VALUE, "tool_calls", "Only assistant messages may have 'tool_calls'.",
            )
        if self.role == "tool" and not self.tool_call_id:
            raise schema_error(
                INVALID_VALUE, "tool_call_id",
                "Messages with role 'tool' must have a 'tool_call_id'.",
            )
        if self.function_call is not None:
            raise schema_error(
                UNSUPPORTED_PARAMETER, "function_call",
                "Assistant 'function_call' is not supported by this server yet.",
            )
        if self.content is None and self.role != "assistant":
            raise schema_error(
                INVALID_VALUE, "content",
                f"Messages with role '{self.role}' must have a 'content'.",
            )
        only_from_user(self.role, self.content, "Image content parts")
        return self

    @property
    def text(self) -> str:
        """The content as one string."""
        return join_text(self.content)


class StreamOptions(RequestModel):
    """`stream_options`: only `include_usage` has an effect."""

    include_usage: bool = False
    include_obfuscation: bool | None = None


class SamplingFields(PlatformFields):
    """Generation parameters shared by chat and legacy completions (ranges: SamplingParams)."""

    #: Structured output, forced by a grammar on the replica (`convert.guided_decoding`).
    response_format: ResponseFormat | None = None
    #: vLLM's structured-output extras: at most one of them, and not with response_format.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: StopString | list[StopString] | None = None
    n: int | None = Field(default=None, le=MAX_N)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    #: vLLM's extras: generate past the end-of-sequence token; keep special tokens in text.
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields, ChatHints):
    """POST /v1/chat/completions."""

    model: ModelName
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, CHAT_UNSUPPORTED)
        reject_unknown(data, [*cls.model_fields, *CHAT_UNSUPPORTED])
        return data

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        choice = self.tool_choice
        if not names and choice not in (None, "none", "auto"):
            raise schema_error(
                INVALID_VALUE, "tool_choice",
                "'tool_choice' is only allowed when 'tools' are specified.",
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise schema_error(
                INVALID_VALUE, "tool_choice",
                f"'tool_choice' names the function '{choice.function.name}', which is not "
                "among 'tools'.",
            )
        if len(set(names)) != len(names):
            raise schema_error(INVALID_VALUE, "tools", "Function names in 'tools' must be "
                               "unique.")
        return self


# ---------------------------------------------------------------------------- completions request

#: (`suffix` is refused per model, when the request is built: `completion_fields`.)
_COMPLETION_UNSUPPORTED: dict[str, Acceptable] = {}

PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions (legacy): a prompt as text, texts, token ids or lists of ids."""

    model: ModelName
    prompt: PromptType
    max_tokens: int | None = 16
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, _COMPLETION_UNSUPPORTED)
        reject_unknown(data, [*cls.model_fields, *_COMPLETION_UNSUPPORTED])
        return data

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, list):
            if not prompt:
                raise schema_error(INVALID_VALUE, "prompt", "'prompt' must not be an empty list.")
            if any(isinstance(p, list) and not p for p in prompt):
                raise schema_error(
                    INVALID_VALUE, "prompt", "'prompt' must not contain an empty token list."
                )
        return self


# ---------------------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class TopLogprob(BaseModel):
    """One alternative token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    """The chosen token at a position, with its alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """`choices[].logprobs` of a chat completion."""

    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """`choices[].message`; `tool_calls` is left out when the reply made no call.
    `annotations` (web-search citations on OpenAI) is always empty here, `refusal` null:
    a moderated reply ends with finish_reason content_filter instead."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    tool_calls: list[ToolCall] | None = None
    #: A reasoning model's thinking (vLLM's and DeepSeek's field); left out when none.
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if getattr(self, key) is None:
                out.pop(key, None)
        return out


class ChatChoice(BaseModel):
    """One of the `n` choices of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: prompt tokens the prefix cache served."""

    cached_tokens: int = 0
    audio_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """`usage.completion_tokens_details` (reasoning tokens of a reasoning model; no audio
    or prediction tokens here)."""

    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class CompletionUsage(BaseModel):
    """`usage`: prompt_tokens includes the cached ones."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(
        default_factory=CompletionTokensDetails
    )


class ChatCompletion(BaseModel):
    """Response of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    service_tier: ServiceTier = SERVICE_TIER
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChunkDelta(BaseModel):
    """`choices[].delta` of a chunk; fields that are not set are left out of the JSON,
    but the role chunk carries `refusal: null`, as OpenAI's first delta does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="plain")
    def _serialize(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.role is not None:
            out["role"] = self.role
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.content is not None:
            out["content"] = self.content
        if self.refusal is not None or self.role is not None:
            out["refusal"] = self.refusal
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChunkChoice(BaseModel):
    """One choice's piece of a streamed chat completion."""

    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE chunk of a streamed chat completion; `usage` is set only on the usage chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    service_tier: ServiceTier = SERVICE_TIER
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions' logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a legacy completion (or its piece, in a stream)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class TextCompletion(BaseModel):
    """Response of /v1/completions, and each chunk of its stream (same object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    #: Left out, not null, where there is none (a chunk before the usage one): the spec's
    #: `CreateCompletionResponse.usage`, which each chunk also is, may not be null.
    usage: CompletionUsage | None = Field(default=None, exclude_if=lambda v: v is None)


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    # Beyond OpenAI's (open) Model object, as vLLM reports them: the context window, and
    # the most output tokens one request may ask for (its default when it asks for none).
    # None for an alias: its deployments' figures are theirs.
    max_model_len: int | None = None
    max_output_tokens: int | None = None
    # What the model can be asked for ("chat", "completions", "embeddings", "vision",
    # "tools"), as Ollama's `capabilities` lists them: a chat client lists only "chat" ones.
    capabilities: list[str] | None = None
    # The sampling a request that leaves a parameter out gets, where it is not the API's
    # default, and where each value comes from ("fleet", "model", "model card").
    sampling_defaults: dict[str, float] | None = None
    sampling_defaults_source: dict[str, str] | None = None
    # Where it is served (a deployment's declared region; an alias's, when all its targets
    # share one): what an org bound to regions may reach.
    region: str | None = None
    # A LoRA adapter's base model (vLLM's field): it runs on that model's replicas.
    parent: str | None = None
    # Whether its model is in memory: "loaded", "loading", "unloading" or "unloaded" (a
    # deployment loaded on demand, `load = "on_demand"`; one loaded always is "loaded");
    # None for an alias: its deployments' states are theirs.
    status: str | None = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    # A regional endpoint's region (`serve --region`): it lists and serves only its own.
    region: str | None = None
