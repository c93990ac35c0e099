"""Speculative decoding in the engine's step: which requests draft, how many tokens, and
what a verified step leaves behind.

Drafts come from n-gram lookup in the request's own tokens (ngram.py) or from a draft
model (draft.py). A running request that decodes (one token left to compute) and may
speculate gets its drafts when the scheduler plans the step: its row computes the last
token and the drafts together (1 + k positions over its cached context, like a prefill
tail) and each position is sampled (verify.py). `settle` then keeps the accepted tokens
and gives back the computed count of the rejected positions: their KV slots are written
again when the right tokens are computed, and a block is registered in the prefix cache
only once its tokens are known (kv_cache.py), so a rejected draft is never cached.

Who may speculate: rows whose sampling does not depend on tokens not yet accepted within
the step, and whose outputs stay one token per step where the API needs it. Not a grammar
(its mask follows each accepted token), not penalties (they count the output so far), not
logprobs (one entry per token per step), not before `min_tokens` are out (stop tokens are
banned until then). Greedy and plain sampling (temperature, top-k/p, min-p, bias, seed)
verify exactly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenyard.engine.request import Request
from tokenyard.engine.spec.draft import DraftConfig, DraftProposer
from tokenyard.engine.spec.ngram import NgramConfig, NgramState, Pacer


def parse_speculative_config(text: str | None) -> NgramConfig | DraftConfig | None:
    """vLLM's `--speculative-config` JSON; None: no speculation.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b} or {"method": "draft_model", "model": m,
    "num_speculative_tokens": k}. As in vLLM, a config without a method is n-gram lookup
    when its "model" is absent or "[ngram]" (vLLM's older spelling), else a draft model."""
    if not text:
        return None
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("speculative_config must be a JSON object")
    model = raw.get("model")
    method = raw.get("method") or ("ngram" if model in (None, "ngram", "[ngram]")
                                   else "draft_model")
    if method not in _FIELDS:
        raise ValueError(f"speculative_config: method {method!r}; 'ngram' and "
                         "'draft_model' are supported")
    unknown = sorted(set(raw) - _FIELDS[method])
    if unknown:
        raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)} for "
                         f"method {method!r}")
    values = {"k": raw.get("num_speculative_tokens", 4)}
    if method == "ngram":
        if model not in (None, "ngram", "[ngram]"):
            raise ValueError(f"speculative_config: method 'ngram' takes no model ({model!r})")
        values.update(min_n=raw.get("prompt_lookup_min", 2),
                      max_n=raw.get("prompt_lookup_max", 4))
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"speculative_config: {name} must be an integer")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config: method 'draft_model' needs \"model\": "
                             "the draft's GGUF file, folder or model name")
        return DraftConfig(model, values["k"])
    if values["max_n"] < values["min_n"]:
        values["min_n"] = values["max_n"]
    return NgramConfig(**values)


_FIELDS = {
    "ngram": {"method", "model", "num_speculative_tokens", "prompt_lookup_min",
              "prompt_lookup_max"},
    "draft_model": {"method", "model", "num_speculative_tokens"},
}


def may_speculate(request: Request) -> bool:
    """Whether the request's sampling can be verified several positions at once."""
    params = request.params
    return (request.guided is None and not params.has_penalties and params.logprobs is None
            and params.n == 1)


@dataclass
class SpecState:
    """One request's lookup buffer (n-gram lookup only) and pacing."""

    tokens: NgramState | None
    pacer: Pacer = field(default_factory=Pacer)


@dataclass
class Speculator:
    """The engine's speculation: proposes at planning, settles after the step.

    Each step the scheduler hands `prepare` its decoding requests before it serves any
    (a draft model proposes for all of them in one batch), then asks `propose` for each
    request's drafts as it serves it, within the step's budget left."""

    config: NgramConfig | DraftConfig
    #: The draft model's proposer (method draft_model); None: n-gram lookup.
    draft: DraftProposer | None = None
    num_drafts: int = 0  # drafts proposed, all requests
    num_accepted: int = 0  # of them accepted
    num_steps: int = 0  # request-steps that verified drafts
    _states: dict[str, SpecState] = field(default_factory=dict)
    _drafts: dict[str, list[int]] = field(default_factory=dict)  # this step's

    def prepare(self, requests: Sequence[Request]) -> None:
        """Propose this step's drafts for `requests` (running, one token left to compute)."""
        wanted: list[tuple[Request, SpecState, int]] = []
        for request in requests:
            state, k = self._wants(request)
            if state is not None and k > 0:
                wanted.append((request, state, k))
        if self.draft is not None:
            self._drafts = self.draft.propose([(r, k) for r, _, k in wanted])
            return
        assert isinstance(self.config, NgramConfig)
        self._drafts = {}
        for request, state, k in wanted:
            assert state.tokens is not None
            drafts = state.tokens.propose(self.config, k)
            if drafts:
                self._drafts[request.request_id] = drafts

    def _wants(self, request: Request) -> tuple[SpecState | None, int]:
        """The request's state and the most drafts it may take now (0: none)."""
        if (request.num_pending or not may_speculate(request)
                or request.num_output_tokens < request.params.min_tokens):
            return None, 0
        state = self._states.get(request.request_id)
        if state is None:
            tokens = (NgramState(request.all_token_ids)
                      if isinstance(self.config, NgramConfig) else None)
            state = self._states[request.request_id] = SpecState(tokens)
        elif state.tokens is not None:
            state.tokens.extend(request.all_token_ids[len(state.tokens):])
        if not state.pacer.active:
            state.pacer.tick()
            return state, 0
        left = request.max_model_len - request.num_tokens - 1
        if request.params.max_tokens is not None:
            left = min(left, request.params.max_tokens - request.num_output_tokens - 1)
        return state, min(self.config.k, left)

    def propose(self, request: Request, budget: int) -> list[int]:
        """The request's drafts this step (at most `budget`), or []."""
        return self._drafts.get(request.request_id, [])[:max(budget, 0)]

    def settle(self, request: Request, drafts: list[int], kept: int) -> None:
        """After a verified step: `kept` of the request's drafts were accepted."""
        self.num_steps += 1
        self.num_drafts += len(drafts)
        self.num_accepted += kept
        state = self._states.get(request.request_id)
        if state is not None:
            state.pacer.record(len(drafts), kept)
        if self.draft is not None:
            self.draft.settle(request.request_id, kept)

    def release(self, request: Request) -> None:
        """The request's KV was freed (finished or preempted): so is its draft KV."""
        if self.draft is not None:
            self.draft.release(request)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
