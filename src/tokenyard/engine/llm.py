"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tokenyard.config import EngineConfig
from tokenyard.engine.frontend import Frontend, Prompt, is_single_prompt
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.outputs import Completion, GenerationResult
from tokenyard.wire.sampling_params import SamplingParams


class LLM:
    """Runs a batch of prompts to completion with continuous batching.

    Keyword arguments are EngineConfig fields (weights="int8", num_kv_blocks=..., ...).
    """

    def __init__(self, model: str | None = None, *, show_progress: bool = False, **config: Any):
        self.frontend = Frontend(EngineConfig.from_env(model=model, **config), show_progress)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    @property
    def core(self) -> Any:
        return self.frontend.core

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        priorities: list[int] | None = None,
        loras: Sequence[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for each prompt: text, token-id lists or conversations (chat template).
        `loras`: per prompt, the LoRA adapter it runs with (None: the base model).

        Returns one GenerationResult per prompt, in order.
        """
        batch: list[Prompt] = (
            [prompts] if is_single_prompt(prompts) else list(prompts)  # type: ignore[list-item,arg-type]
        )
        if params is None:
            params = SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(batch)
        if len(param_list) != len(batch):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, GenerationResult] = {}
        order: list[str] = []
        for i, (prompt, p) in enumerate(zip(batch, param_list, strict=True)):
            request_id = f"offline-{next(self._ids)}"
            ids = self.frontend.prompt_token_ids(prompt)
            self.frontend.add_request(
                request_id, ids, p, cache_salt=cache_salt,
                priority=priorities[i] if priorities else 0,
                lora=loras[i] if loras else None,
            )
            results[request_id] = GenerationResult(
                request_id, ids, [Completion(index) for index in range(p.n)]
            )
            order.append(request_id)
        while self.frontend.has_work:
            for out in self.frontend.step():
                result = results[out.request_id]
                result.num_cached_tokens = out.num_cached_tokens
                for delta in out.deltas:
                    result.completions[delta.index].add(delta)
        return [results[request_id] for request_id in order]
