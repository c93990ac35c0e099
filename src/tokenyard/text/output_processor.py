"""Between the engine core and callers: n fan-out, detokenization and stop strings.

The core works on token ids only; this side turns each step's new tokens into text deltas,
holds back any text that might be the start of a stop string, and tells the core to
finish a completion whose text matched one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenyard.text.detokenizer import IncrementalDetokenizer
from tokenyard.text.stop import StopStringMatcher, StopStrings
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.outputs import (
    CompletionDelta,
    EngineCoreOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
)
from tokenyard.wire.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The core's id for completion `index` of a request (the request id itself when n=1)."""
    return request_id if n == 1 else f"{request_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of n samples with seed + index, so seeded siblings differ."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=params.seed + index)


@dataclass
class _Completion:
    parent: _Parent
    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None
    num_tokens: int = 0
    finished: bool = False


@dataclass
class _Parent:
    request_id: str
    n: int
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_finished: int = 0
    children: list[_Completion] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._children: dict[str, _Completion] = {}
        self._parents: dict[str, _Parent] = {}

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[str]:
        """Track a request; returns the core ids of its n completions."""
        parent = _Parent(request_id, params.n, prompt_token_ids)
        self._parents[request_id] = parent
        ids = []
        # Prepared once for the n completions: only the matchers' small states are per child.
        prepared = StopStrings(params.stop)
        for index in range(params.n):
            child_id = child_request_id(request_id, index, params.n)
            stops = (
                StopStringMatcher(prepared, params.include_stop_str_in_output)
                if prepared else None
            )
            child = _Completion(
                parent,
                index,
                IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens
                ),
                stops,
            )
            parent.children.append(child)
            self._children[child_id] = child
            ids.append(child_id)
        return ids

    def child_ids(self, request_id: str) -> list[str]:
        """Core ids of a tracked request's completions ([] if unknown)."""
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        return [child_request_id(request_id, c.index, parent.n) for c in parent.children]

    def remove(self, request_id: str) -> list[str]:
        """Stop tracking a request; returns its completions' core ids."""
        ids = self.child_ids(request_id)
        self._parents.pop(request_id, None)
        for child_id in ids:
            self._children.pop(child_id, None)
        return ids

    def process(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Turn core outputs into per-request deltas.

        Returns the deltas and the (core id, stop string) pairs the core must finish.
        """
        by_parent: dict[str, list[CompletionDelta]] = {}
        stopped: list[tuple[str, str]] = []
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None or child.finished:
                continue  # aborted, or already stopped by a stop string
            parent = child.parent
            if child.index == 0:
                parent.num_cached_tokens = out.num_cached_tokens
            child.num_tokens += len(out.new_token_ids)
            parent.num_output_tokens += len(out.new_token_ids)
            text = child.detokenizer.push(out.new_token_ids)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            matched: str | None = None
            if child.stops is not None:
                text, matched = child.stops.push(text)
            if finish_reason is not None and matched is None:
                # EOS, a stop token or the length cap: release what was held back.
                tail = child.detokenizer.flush()
                if child.stops is not None:
                    tail, matched = child.stops.push(tail)
                    text += tail if matched is not None else tail + child.stops.flush()
                else:
                    text += tail
            if matched is not None:
                if out.finish_reason is None:
                    stopped.append((out.request_id, matched))
                finish_reason, stop_reason = "stop", matched
            logprobs = None
            if out.new_logprobs is not None:
                logprobs = [
                    Logprob(tok, lp.logprob, lp.top)
                    for tok, lp in zip(out.new_token_ids, out.new_logprobs, strict=True)
                ]
            if finish_reason is not None:
                child.finished = True
                parent.num_finished += 1
            by_parent.setdefault(parent.request_id, []).append(
                CompletionDelta(
                    child.index, text, list(out.new_token_ids), logprobs,
                    finish_reason, stop_reason, _prompt_logprobs(parent, out),
                )
            )
        results = []
        for request_id, deltas in by_parent.items():
            parent = self._parents[request_id]
            finished = parent.num_finished == parent.n
            results.append(
                RequestOutput(
                    request_id, deltas, finished, parent.num_prompt_tokens,
                    parent.num_cached_tokens, parent.num_output_tokens,
                )
            )
            if finished:
                self.remove(request_id)
        return results, stopped


def _prompt_logprobs(parent: _Parent, out: EngineCoreOutput) -> PromptLogprobs | None:
    """The prompt's scores an output carries (its request's first), with their tokens."""
    scored = out.prompt_logprobs
    if scored is None:
        return None
    prompt = parent.prompt_token_ids
    return PromptLogprobs(list(prompt), [
        Logprob(token, lp.logprob, list(lp.top))
        for token, lp in zip(prompt[1:], scored, strict=True)
    ])
