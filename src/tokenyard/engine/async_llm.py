"""The asynchronous API: per-step deltas of one request, aborted when the consumer stops.

`AsyncEngineCore` (token ids, step loop on its own thread) plus an `OutputProcessor` on
the caller's side: prompts are tokenized, outputs detokenized and stop strings matched
in the caller's event loop — the same split the HTTP process and a replica make, only
without the wire between them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from tokenyard.config import EngineConfig
from tokenyard.engine.async_core import AsyncEngineCore
from tokenyard.engine.core import EngineStats
from tokenyard.engine.frontend import Prompt, make_request, prompt_token_ids
from tokenyard.text.output_processor import OutputProcessor, child_params
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.outputs import RequestOutput
from tokenyard.wire.sampling_params import SamplingParams


class AsyncLLM:
    """Streams generations from an in-process engine replica.

    Keyword arguments are EngineConfig fields (weights="int8", num_kv_blocks=..., ...).
    """

    def __init__(self, model: str | None = None, *, show_progress: bool = False, **config: Any):
        self.config = EngineConfig.from_env(model=model, **config)
        self.engine = AsyncEngineCore(self.config, show_progress=show_progress)
        self._children: dict[str, list[str]] = {}  # request id -> its core ids, while open

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """The engine's counters (running, waiting, KV blocks, prefix cache, ...)."""
        return self.engine.stats()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield this request's deltas step by step until every completion finishes.

        The engine's refusal (prompt too long: ValueError; queue full: QueueFullError) is
        raised before the first item. Leaving the iteration early (break, cancellation, a
        closed client) aborts the request in the engine and frees its KV blocks.
        """
        if not self.engine.is_running:
            raise RuntimeError("the engine is shut down")
        request_id = request_id or uuid.uuid4().hex
        ids = prompt_token_ids(self.tokenizer, prompt)
        # One processor per request: its state then lives in this generator alone, so
        # requests from different event loops or threads never share it.
        processor = OutputProcessor(self.tokenizer)
        child_ids = processor.add_request(request_id, ids, params)
        requests = [
            make_request(
                child_id, ids, child_params(params, index), self.engine.eos_token_ids,
                cache_salt=cache_salt, priority=priority, lora=lora,
            )
            for index, child_id in enumerate(child_ids)
        ]
        stream = await self.engine.submit(requests)
        self._children[request_id] = child_ids
        try:
            async for batch in stream:
                outputs, stopped = processor.process(batch)
                for child_id, stop in stopped:
                    self.engine.finish_with_stop_string(child_id, stop)
                for out in outputs:
                    yield out
                    if out.finished:
                        return
        finally:
            self._children.pop(request_id, None)
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request; its iteration ends with finish_reason "abort"."""
        for child_id in self._children.get(request_id) or [request_id]:
            self.engine.abort(child_id)

    def shutdown(self) -> None:
        """Stop the engine's step loop (open iterations fail with RuntimeError)."""
        self.engine.shutdown()
