"""One request's state inside the engine: its token list and how much of it is computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenyard.engine.sample.grammar import GuidedState
from tokenyard.wire.outputs import TokenLogprobs
from tokenyard.wire.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass
class Request:
    """A sequence being generated.

    The whole state is `all_token_ids` (prompt then output) and `num_computed_tokens`, the
    prefix of it whose KV is in the cache. Prefill, chunked prefill, prefix-cache hits and
    recompute after preemption are all `num_computed_tokens` catching up with the list.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 8192
    cache_salt: str | None = None
    priority: int = 0  # lower runs first, as in vLLM
    #: Prompt prefixes to keep in the KV cache: (number of tokens, TTL in seconds) each.
    pins: tuple[tuple[int, float], ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    #: The grammar of a constrained request (set by the core when it is added).
    guided: GuidedState | None = None
    #: The LoRA adapter the request runs with (None: the base model), and the bank slot
    #: it holds while it runs (0: none; engine/lora/manager.py).
    lora: str | None = None
    lora_slot: int = 0

    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    #: Tokens scheduled to be sampled whose ids are not back yet (0 or 1). With async
    #: scheduling the next step is planned while this one runs: its input for this request
    #: is the token still being sampled, a placeholder the runner fills in.
    num_pending: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache; -1 until scheduled
    num_preemptions: int = 0
    #: Tokens the last step appended (more than one when it verified drafts).
    num_new_tokens: int = 0
    #: With `params.prompt_logprobs`: prompt tokens 1, 2, … scored so far (see
    #: `scores_prompt`); sent with the first output token.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # Monotonic timeline stamps (seconds); intervals are computed by the caller.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending

    @property
    def ends_by_length_with_pending(self) -> bool:
        """True if the token in flight will be the last one `max_tokens` or the context
        window allows: nothing after it is worth scheduling."""
        return bool(self.num_pending) and self._length_reached(self.num_pending)

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt positions are still to be scored: then the whole prompt is
        computed, none of it read from the prefix cache (a cached block has no logits)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: priority class first, then arrival."""
        return (self.priority, self.arrival_time)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.guided is not None:
            self.guided.advance(self.output_token_ids)

    def check_stop(self) -> RequestStatus | None:
        """After a token is appended: the finished status it causes, or None to go on.

        EOS and stop token ids are honoured only once `min_tokens` are out; a stop string is
        matched by the detokenizing frontend, which aborts the request with a stop reason.
        A constrained request also stops once its grammar has ended (its matcher took EOS,
        which the mask allows only there).
        """
        params = self.params
        tokens = self.all_token_ids
        last = tokens[-1]
        if self.guided is not None:
            if self.guided.rejected:  # cannot happen through the sampler's mask
                return RequestStatus.FINISHED_ABORTED
            if self.guided.terminated:  # the grammar ended and took EOS
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
        if len(tokens) - len(self.prompt_token_ids) >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH if self._length_reached(0) else None

    def _length_reached(self, extra: int) -> bool:
        """Whether `max_tokens` or the context window is reached with `extra` more tokens."""
        max_tokens = self.params.max_tokens
        num_tokens = len(self.all_token_ids) + extra
        return ((max_tokens is not None
                 and num_tokens - len(self.prompt_token_ids) >= max_tokens)
                or num_tokens >= self.max_model_len)
