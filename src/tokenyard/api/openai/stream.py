"""The OpenAI dialect's streams: the chunks of one streamed chat or legacy completion,
and their `Format`s for the one response writer (`api/respond.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel

from tokenyard.api.convert import now
from tokenyard.api.openai.completion_fields import BestOf, choose
from tokenyard.api.openai.convert import (
    build_chat_completion,
    build_text_completion,
    chat_logprobs,
    legacy_finish_reason,
    need_bytes,
    new_chat_id,
    new_completion_id,
    no_bytes,
    openai_finish_reason,
    openai_usage,
)
from tokenyard.api.openai.legacy_logprobs import (
    OffsetCounter,
    TokenBytes,
    completion_logprobs_at,
    prompt_logprobs,
)
from tokenyard.api.openai.schemas import (
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    CompletionChoice,
    TextCompletion,
)
from tokenyard.api.openai.tools import delta_parts
from tokenyard.api.openai.tools import parser as tool_parser
from tokenyard.api.sse import SSE_DONE, openai_stream_error, sse_data
from tokenyard.errors import APIError
from tokenyard.gateway.call import Generated
from tokenyard.text.reasoning import ReasoningDelta, ReasoningStream
from tokenyard.text.tool_calls import MarkupFilter, ToolCallParser
from tokenyard.text.tools import ToolUse
from tokenyard.wire.outputs import Completion, CompletionDelta, PromptLogprobs, RequestOutput

#: The `system_fingerprint` of every OpenAI response.
SYSTEM_FINGERPRINT = "tokenyard"


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
    #: The request's tools: each choice's calls are parsed out of its text as it streams.
    tools: ToolUse | None = None
    #: The deployment's reasoning parser, and whether the prompt opened the block: each
    #: choice's thinking goes to `reasoning_content`, its tokens to `reasoning_tokens`.
    reasoning: tuple[str, bool] | None = None
    _started: set[int] = field(default_factory=set)
    _parsers: dict[int, ToolCallParser | None] = field(default_factory=dict)
    _plain: dict[int, MarkupFilter] = field(default_factory=dict)  # choices without tools
    _thinking: dict[int, ReasoningStream] = field(default_factory=dict)

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
            logprobs = chat_logprobs(delta.logprobs, need_bytes(self.token_bytes))
        parser = self._parsers.setdefault(delta.index, tool_parser(self.tools))
        text, calls = delta.text, None
        split = self._think(delta)
        thought = None if split is None else split.reasoning or None
        if split is not None:
            text = split.content
        if parser is not None:
            events = parser.feed(text)
            if delta.finish_reason is not None:
                events += parser.finish()
            text, tool_deltas = delta_parts(events)
            calls = tool_deltas or None
        else:
            plain = self._plain.get(delta.index)
            if plain is None:
                plain = self._plain[delta.index] = MarkupFilter(self.tools)
            text = plain.feed(text, delta.finish_reason is not None)
        if text or logprobs is not None or calls or thought:
            out.append(self._chunk(ChunkChoice(
                index=delta.index,
                delta=ChunkDelta(content=text or None if calls or thought else text,
                                 tool_calls=calls, reasoning_content=thought),
                logprobs=logprobs,
            )))
        finish = openai_finish_reason(delta.finish_reason)
        if finish == "stop" and parser is not None and parser.made_calls:
            finish = "tool_calls"
        if finish is not None:
            out.append(self._chunk(
                ChunkChoice(index=delta.index, delta=ChunkDelta(), finish_reason=finish)
            ))
        return out

    def _think(self, delta: CompletionDelta) -> ReasoningDelta | None:
        """The reasoning and the answer in one delta's text (None: no reasoning parser)."""
        if self.reasoning is None:
            return None
        if delta.index not in self._thinking:
            self._thinking[delta.index] = ReasoningStream(self.token_bytes or no_bytes,
                                                          *self.reasoning)
        return self._thinking[delta.index].push(delta.text, delta.token_ids,
                                                delta.finish_reason is not None)

    @property
    def reasoning_tokens(self) -> int:
        """The reasoning tokens of every choice so far."""
        return sum(stream.tokens for stream in self._thinking.values())

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
            usage=openai_usage(prompt_tokens, completion_tokens, cached_tokens,
                               self.reasoning_tokens),
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
    _offsets: dict[int, OffsetCounter] = field(default_factory=dict)

    def _chunk(self, choice: CompletionChoice) -> TextCompletion:
        return TextCompletion(
            id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.system_fingerprint, choices=[choice],
        )

    def echo_chunks(self, prompt_index: int, prompt_text: str) -> list[TextCompletion]:
        """With `echo`: the prompt's text as the first chunk of each of its `n` choices."""
        return [self.echo_chunk(prompt_index * self.n + j, prompt_text) for j in range(self.n)]

    def echo_chunk(self, index: int, prompt_text: str,
                   scored: PromptLogprobs | None = None) -> TextCompletion:
        """Choice `index`'s first chunk with `echo`: the prompt's text, and its tokens'
        logprobs when it was scored (`echo` with `logprobs`)."""
        self._offsets[index] = OffsetCounter(len(prompt_text))
        logprobs = None
        if scored is not None:
            logprobs = prompt_logprobs(scored, need_bytes(self.token_bytes))
        return self._chunk(CompletionChoice(index=index, text=prompt_text, logprobs=logprobs))

    def delta_chunks(self, delta: CompletionDelta, prompt_index: int = 0) -> list[TextCompletion]:
        """The chunk for one engine delta of prompt `prompt_index` (none if nothing new)."""
        index = prompt_index * self.n + delta.index
        logprobs = None
        if delta.logprobs:
            offsets = self._offsets.setdefault(index, OffsetCounter())
            logprobs = completion_logprobs_at(delta.logprobs, need_bytes(self.token_bytes),
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


# ---------------------------------------------------------------------------- formats


class _OpenAIFormat:
    """What both OpenAI responses share: bare ``data:`` events ending in ``[DONE]``, the
    usage chunk last when the client asked for it, the error as ``data: {"error": …}``."""

    terminator = SSE_DONE

    def __init__(self, stream: ChatStream | CompletionStream, n: int, include_usage: bool,
                 token_bytes: TokenBytes) -> None:
        self.stream = stream
        self.n = n
        self.include_usage = include_usage
        self.token_bytes = token_bytes

    def tail(self, gens: Sequence[Generated]) -> list[BaseModel]:
        if not self.include_usage:
            return []
        output_tokens = sum(g.last.num_output_tokens for g in gens if g.last is not None)
        return [self.stream.usage_chunk(sum(g.num_prompt_tokens for g in gens), output_tokens,
                                        sum(g.num_cached_tokens for g in gens))]

    def encode(self, event: Any) -> bytes:
        return sse_data(event)

    def error(self, err: APIError) -> bytes:
        return openai_stream_error(err)


class ChatFormat(_OpenAIFormat):
    """A chat completion of one prompt's n choices."""

    def __init__(self, model: str, n: int, include_usage: bool, token_bytes: TokenBytes,
                 tools: ToolUse | None = None,
                 reasoning: tuple[str, bool] | None = None) -> None:
        self.stream: ChatStream = ChatStream(new_chat_id(), model, now(), SYSTEM_FINGERPRINT,
                                             token_bytes, tools, reasoning)
        super().__init__(self.stream, n, include_usage, token_bytes)

    def body(
        self, gens: Sequence[Generated], completions: Sequence[list[Completion]]
    ) -> BaseModel:
        gen, stream = gens[0], self.stream
        return build_chat_completion(
            id=stream.id, model=stream.model, created=stream.created,
            completions=completions[0], prompt_tokens=gen.num_prompt_tokens,
            cached_tokens=gen.num_cached_tokens, token_bytes=self.token_bytes,
            system_fingerprint=SYSTEM_FINGERPRINT,
            completion_tokens=gen.last.num_output_tokens if gen.last is not None else 0,
            tools=self.stream.tools, reasoning=self.stream.reasoning,
        )

    def head(self) -> list[BaseModel]:
        # The role chunks go out with the first step's (already received) output.
        return list(self.stream.role_chunks(self.n))

    def events(self, index: int, out: RequestOutput) -> list[BaseModel]:
        return list(self.stream.output_chunks(out))



class CompletionFormat(_OpenAIFormat):
    """A legacy completion of several prompts: choice i*n+j is completion j of prompt i;
    every prompt streams at once and the choice indexes tell them apart."""

    def __init__(self, model: str, n: int, include_usage: bool, token_bytes: TokenBytes,
                 echo: list[str] | None, best: BestOf | None = None, *,
                 scored: bool = False) -> None:
        """`scored`: the client asked for the echoed prompts' logprobs (`echo` with
        `logprobs`): each choice's echo chunk waits for its first output, which brings
        them. Without it, scores computed only to generate nothing (`max_tokens` 0) are
        left out."""
        self.stream: CompletionStream = CompletionStream(
            new_completion_id(), model, now(), n, SYSTEM_FINGERPRINT, token_bytes)
        super().__init__(self.stream, n, include_usage, token_bytes)
        self.echo = echo
        #: `best_of` > n: the n best of each prompt's completions are the choices (not
        #: streamed); usage still counts every completion's tokens.
        self.best = best
        self.scored = scored and echo is not None
        self._echoed: set[int] = set()  # choices whose echo chunk went out (scored)

    def body(
        self, gens: Sequence[Generated], completions: Sequence[list[Completion]]
    ) -> BaseModel:
        stream = self.stream
        if not self.scored:
            completions = [[replace(c, prompt_logprobs=None) for c in per]
                           for per in completions]
        if self.best is not None:
            completions = choose(completions, self.best)
        return build_text_completion(
            id=stream.id, model=stream.model, created=stream.created,
            completions=completions, n=self.n,
            prompt_tokens=sum(g.num_prompt_tokens for g in gens),
            cached_tokens=sum(g.num_cached_tokens for g in gens),
            token_bytes=self.token_bytes, echo_prompts=self.echo,
            system_fingerprint=SYSTEM_FINGERPRINT,
            completion_tokens=sum(g.last.num_output_tokens for g in gens if g.last is not None),
        )

    def head(self) -> list[BaseModel]:
        if self.scored:
            return []  # each echo chunk goes out with its choice's first output
        return [chunk for i, text in enumerate(self.echo or [])
                for chunk in self.stream.echo_chunks(i, text)]

    def events(self, index: int, out: RequestOutput) -> list[BaseModel]:
        chunks: list[BaseModel] = []
        for delta in out.deltas:
            choice = index * self.n + delta.index
            if self.scored and self.echo is not None and choice not in self._echoed:
                self._echoed.add(choice)
                chunks.append(self.stream.echo_chunk(choice, self.echo[index],
                                                     delta.prompt_logprobs))
            chunks.extend(self.stream.delta_chunks(delta, index))
        return chunks

