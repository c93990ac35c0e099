"""What the engine hands back: the core's per-step outputs (token ids) and, after
detokenization, per-step deltas and finished generations. Torch-free, so the HTTP side
can import it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar


@dataclass
class Logprob:
    """One generated token with its logprob and the top alternatives (raw model logits)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """The prompt scored token by token: `entries[i]` is prompt token `i + 1`'s logprob
    given the tokens before it, with the top alternatives (the first token has none)."""

    token_ids: list[int]
    entries: list[Logprob]


@dataclass
class CompletionDelta:
    """New output of one of the `n` completions of a request, since the last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None  # the stop string or stop token id that matched
    #: With the first token of a request that asked for `prompt_logprobs`.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class RequestOutput:
    """One step's output for a request (streaming) — deltas of the completions that moved."""

    request_id: str
    deltas: list[CompletionDelta]
    finished: bool  # every completion is done
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache served (completion 0's count)
    num_output_tokens: int  # generated so far, all completions together


@dataclass
class Completion:
    """A finished completion, accumulated from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass
class GenerationResult:
    """Everything a request produced (the offline API's return value)."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the most likely alternatives, from raw logits."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class EngineCoreOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # "stop", "length" or None while running
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # On a request's first output only (seconds): arrival → first scheduled, and first
    # scheduled → first token. The HTTP side splits its Server-Timing "queue" and "prefill"
    # with them.
    queue_time: float | None = None
    prefill_time: float | None = None
    #: With the first token of a request that asked for `prompt_logprobs`: one entry per
    #: prompt token after the first (its logprob given the tokens before it).
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_kv_blocks: int
    num_free_kv_blocks: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    num_computed_tokens: int  # tokens run through the model since start
    num_pinned_kv_blocks: int = 0  # blocks kept by prompt-cache pins (cache_control)
    #: Steps planned while the step before still computed (async scheduling), since start.
    num_overlapped_steps: int = 0
    #: Cached blocks evicted (their hash dropped) to make room, since start.
    num_evicted_kv_blocks: int = 0
    #: Speculative decoding since start: drafts verified, and of them accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @classmethod
    def summed(cls, parts: Sequence[EngineStats]) -> EngineStats:
        """Several replicas' figures as one: counts summed, the KV use averaged."""
        total = cls(**{f: sum(getattr(s, f) for s in parts) for f in cls.__dataclass_fields__})
        total.kv_cache_usage = sum(s.kv_cache_usage for s in parts) / len(parts)
        return total


class _StepOutput(Protocol):
    """What `merge_steps` reads of a step's output for one request: the engine's
    `EngineCoreOutput` and the HTTP side's `CoreDelta` alike (both dataclasses)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Any
    finish_reason: str | None
    queue_time: float | None
    prefill_time: float | None
    prompt_logprobs: Any


S = TypeVar("S", bound=_StepOutput)


def merge_steps(outputs: Sequence[S]) -> list[S]:
    """Several steps' outputs as one per request, in order of first appearance: the
    tokens (and logprobs) of a request's outputs joined, the first-output fields
    (`queue_time`, `prefill_time`, `prompt_logprobs`) of its first, the rest (finish and
    stop reason, token counts) of its last. What a consumer that fell behind the engine
    takes in one go: a frame, a detokenizer push and an event per request instead of one
    per step, so the slower it is the less each token costs it (a token that its own
    step would have delivered later is delivered no later). Outputs are not modified."""
    if len(outputs) < 2 or len({out.request_id for out in outputs}) == len(outputs):
        return list(outputs)  # one step's outputs: nothing to join (the common case)
    groups: dict[str, list[S]] = {}
    for out in outputs:
        groups.setdefault(out.request_id, []).append(out)
    return [group[0] if len(group) == 1 else _joined(group) for group in groups.values()]


def _joined(group: list[S]) -> S:
    first, last = group[0], group[-1]
    ids = [t for out in group for t in out.new_token_ids]
    logprobs = (None if first.new_logprobs is None
                else [lp for out in group for lp in out.new_logprobs or ()])
    return replace(last, new_token_ids=ids, new_logprobs=logprobs,  # type: ignore[type-var]
                   queue_time=first.queue_time, prefill_time=first.prefill_time,
                   prompt_logprobs=first.prompt_logprobs)
