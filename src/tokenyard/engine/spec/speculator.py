"""Speculative decoding in the engine's step: which requests draft, how many tokens, and
what a verified step leaves behind.

A running request that decodes (one token left to compute) and may speculate gets its
drafts when the scheduler plans the step: its row computes the last token and the drafts
together (1 + k positions over its cached context, like a prefill tail) and each position
is sampled (verify.py). `settle` then keeps the accepted tokens and gives back the
computed count of the rejected positions: their KV slots are written again when the right
tokens are computed, and a block is registered in the prefix cache only once its tokens
are known (kv_cache.py), so a rejected draft is never cached.

Who may speculate: rows whose sampling does not depend on tokens not yet accepted within
the step, and whose outputs stay one token per step where the API needs it. Not a grammar
(its mask follows each accepted token), not penalties (they count the output so far), not
logprobs (one entry per token per step), not before `min_tokens` are out (stop tokens are
banned until then). Greedy and plain sampling (temperature, top-k/p, min-p, bias, seed)
verify exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenyard.engine.request import Request
from tokenyard.engine.spec.ngram import NgramConfig, NgramState, Pacer


def parse_speculative_config(text: str | None) -> NgramConfig | None:
    """vLLM's `--speculative-config` JSON: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b}; None: no speculation."""
    if not text:
        return None
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("speculative_config must be a JSON object")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}")
    method = raw.get("method", "ngram")
    if method != "ngram":
        raise ValueError(f"speculative_config: method {method!r}; only 'ngram' is "
                         "supported (a draft model is not)")
    values = {"k": raw.get("num_speculative_tokens", 4),
              "min_n": raw.get("prompt_lookup_min", 2),
              "max_n": raw.get("prompt_lookup_max", 4)}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"speculative_config: {name} must be an integer")
    if values["max_n"] < values["min_n"]:
        values["min_n"] = values["max_n"]
    return NgramConfig(**values)


def may_speculate(request: Request) -> bool:
    """Whether the request's sampling can be verified several positions at once."""
    params = request.params
    return (request.guided is None and not params.has_penalties and params.logprobs is None
            and params.n == 1)


@dataclass
class SpecState:
    """One request's lookup buffer, pacing and the drafts of the step being planned."""

    tokens: NgramState
    pacer: Pacer = field(default_factory=Pacer)
    drafts: list[int] = field(default_factory=list)


@dataclass
class Speculator:
    """The engine's speculation: proposes at planning, settles after the step."""

    config: NgramConfig
    num_drafts: int = 0  # drafts proposed, all requests
    num_accepted: int = 0  # of them accepted
    num_steps: int = 0  # request-steps that verified drafts
    _states: dict[str, SpecState] = field(default_factory=dict)

    def propose(self, request: Request, budget: int) -> list[int]:
        """Drafts for a decoding request this step (at most `budget`), or []."""
        if (budget <= 0 or request.num_pending or not may_speculate(request)
                or request.num_output_tokens < request.params.min_tokens):
            return []
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = SpecState(
                NgramState(request.all_token_ids))
        else:
            state.tokens.extend(request.all_token_ids[len(state.tokens):])
        if not state.pacer.active:
            state.pacer.tick()
            return []
        left = request.max_model_len - request.num_tokens - 1
        if request.params.max_tokens is not None:
            left = min(left, request.params.max_tokens - request.num_output_tokens - 1)
        drafts = state.tokens.propose(self.config, min(self.config.k, budget, left))
        state.drafts = drafts
        return drafts

    def settle(self, request: Request, drafts: list[int], kept: int) -> None:
        """After a verified step: `kept` of the request's drafts were accepted."""
        self.num_steps += 1
        self.num_drafts += len(drafts)
        self.num_accepted += kept
        state = self._states.get(request.request_id)
        if state is not None:
            state.pacer.record(len(drafts), kept)
            state.drafts = []

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def active(self) -> bool:
        """Whether any request may draft (async overlap is off while one may)."""
        return bool(self._states)
