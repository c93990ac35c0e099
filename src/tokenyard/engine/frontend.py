"""The engine as callers see it: prompts in, per-step RequestOutputs out.

`build_core` builds a replica (model, KV cache, scheduler) for every caller. `Frontend`
drives one synchronously for the offline `LLM`: it turns prompts into token ids, fans a
request out into its n completions, and applies stop strings. The asynchronous side
(`AsyncEngineCore`, `AsyncLLM`, the replica server) reuses the same pieces.
"""

from __future__ import annotations

import ctypes
import gc
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch

from tokenyard.config import EngineConfig
from tokenyard.engine.core import EngineCore, kernel_thread, resolve_device
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.families import CausalLM
from tokenyard.engine.models.loader import (
    LoadedModel,
    build_model,
    load_gguf_blocks,
    load_model,
)
from tokenyard.engine.request import Request
from tokenyard.engine.spec.draft import DraftConfig, DraftModel, check_same_vocabulary
from tokenyard.engine.spec.speculator import parse_speculative_config
from tokenyard.text.output_processor import OutputProcessor, child_params

# The prompt helpers live in a torch-free module (the HTTP process uses them); re-exported
# here for the engine's callers.
from tokenyard.text.prompts import Conversation, Prompt, prompt_token_ids, render_conversation
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.outputs import RequestOutput
from tokenyard.wire.sampling_params import SamplingParams

__all__ = [
    "BuiltCore", "Conversation", "Frontend", "Prompt", "build_core", "is_single_prompt",
    "make_request", "prompt_token_ids", "render_conversation",
]


def is_single_prompt(prompts: Any) -> bool:
    """A str, a list of token ids, or one conversation (a list of message dicts)."""
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, list) and prompts:
        return isinstance(prompts[0], int | dict)
    return False


@dataclass(frozen=True)
class BuiltCore:
    """A replica's engine core and what callers need beside it."""

    core: EngineCore
    tokenizer: Tokenizer
    model_config: ModelConfig
    eos_token_ids: frozenset[int]  # the tokenizer's and the model config's, together
    weights: str  # the format served: config.weights with `auto` resolved (float32 on CUDA)


def build_core(config: EngineConfig, show_progress: bool = True) -> BuiltCore:
    """Load the model of `config` onto its device and build an EngineCore around it.

    The one place a replica is built: the offline `LLM`, `AsyncEngineCore` and the
    replica server all come through here. With async scheduling the whole build runs on
    the core's kernel thread, where its forward passes will run.
    """
    if not config.async_scheduling:
        return _build_core(config, show_progress, None)
    kernels = kernel_thread()
    try:
        return kernels.submit(_build_core, config, show_progress, kernels).result()
    except BaseException:
        kernels.shutdown()
        raise


def _build_core(config: EngineConfig, show_progress: bool,
                kernels: ThreadPoolExecutor | None) -> BuiltCore:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if config.null_model:
        return _build_null_core(config, device, dtype, kernels)
    model, loaded, weights = _load_causal_lm(config.model, config, device, dtype,
                                             show_progress)
    tokenizer: Tokenizer = loaded.tokenizer
    eos = frozenset(set(tokenizer.eos_token_ids) | set(loaded.config.eos_token_ids))
    core = EngineCore(model, loaded.config, config, device, dtype, tokenizer=tokenizer,
                      kernels=kernels,
                      draft=_load_draft(config, loaded, device, dtype, show_progress))
    return BuiltCore(core, tokenizer, loaded.config, eos, weights)


def _load_causal_lm(name: str | None, config: EngineConfig, device: torch.device,
                    dtype: torch.dtype,
                    show_progress: bool) -> tuple[CausalLM, LoadedModel, str]:
    """Model `name` on `device`, in the weight format `config` asks for: the model, what
    was loaded (its float32 weights dropped) and the format (`auto` resolved)."""
    loaded = load_model(name, config.cache_dir, show_progress=show_progress)
    if config.weights not in ("auto", "float32") and device.type != "cpu":
        raise ValueError(f"{config.weights} weights are a CPU mode; on CUDA the engine "
                         "uses bf16")
    from tokenyard.engine.models.quant import convert_weights, native_names, resolve_weights

    weights = resolve_weights(config.weights, loaded.source, device)
    # The GGUF's own blocks, served as they are: their float32 copies are never loaded.
    native = load_gguf_blocks(loaded) if weights == "q4_1" else {}
    model = build_model(loaded, skip=native_names(native, loaded.config))
    if weights != "float32":
        model = convert_weights(model, loaded, weights, native)
    else:
        model = model.to(device=device, dtype=dtype)
    loaded.weights = {}  # the float32 copy of every parameter, no longer needed
    release_freed_memory()
    if device.type == "cpu":
        model.set_threads(torch.get_num_threads())
    return model, loaded, weights


def _load_draft(config: EngineConfig, target: LoadedModel, device: torch.device,
                dtype: torch.dtype, show_progress: bool) -> DraftModel | None:
    """The draft model `speculative_config` names (None: it names none), checked to
    share the target's tokenizer."""
    spec = parse_speculative_config(config.speculative_config)
    if not isinstance(spec, DraftConfig):
        return None
    model, loaded, _ = _load_causal_lm(spec.model, config, device, dtype, show_progress)
    check_same_vocabulary(target.config, target.tokenizer, loaded.config, loaded.tokenizer)
    return DraftModel(model, loaded.config)


def _build_null_core(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                     kernels: ThreadPoolExecutor | None) -> BuiltCore:
    """An engine core around the model that computes nothing (engine/null_model.py)."""
    from tokenyard.engine.null_model import NullModel, null_model_config

    model_config, tokenizer = null_model_config(config.cache_dir)
    # The runner calls the model through the families' interface, which NullModel has.
    model = cast(CausalLM, NullModel().to(device))
    eos = frozenset(set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids))
    core = EngineCore(model, model_config, config, device, dtype, tokenizer=tokenizer,
                      kernels=kernels)
    return BuiltCore(core, tokenizer, model_config, eos, "null")


def release_freed_memory() -> None:
    """Hand the heap pages freed by the load back to the kernel.

    Converting to block weights frees the float32 parameters, but glibc keeps freed
    chunks below its mmap threshold (most per-layer tensors) in the heap: measured
    ~170 MB of RSS on SmolLM2-135M until `malloc_trim`. A no-op off glibc.
    """
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    *,
    cache_salt: str | None = None,
    priority: int = 0,
    lora: str | None = None,
) -> Request:
    """One core request (a single completion); the runner makes its seeded generator.
    `lora`: the adapter it runs with (None: the base model)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        params=params,
        eos_token_ids=eos_token_ids,
        cache_salt=cache_salt,
        priority=priority,
        lora=lora,
    )


class Frontend:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        built = build_core(config, show_progress)
        self.config = config
        self.model_config = built.model_config
        self.model_name = built.model_config.name
        self.tokenizer: Tokenizer = built.tokenizer
        self.eos_token_ids = built.eos_token_ids
        self.weights = built.weights  # the format served (`auto` resolved)
        self.core = built.core
        self.processor = OutputProcessor(self.tokenizer)

    def prompt_token_ids(self, prompt: Prompt, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a text prompt, a token list, or a conversation (chat template)."""
        return prompt_token_ids(self.tokenizer, prompt, add_generation_prompt)

    def render_chat(self, messages: Conversation, add_generation_prompt: bool = True) -> str:
        return render_conversation(self.tokenizer, messages, add_generation_prompt)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> None:
        """Queue all n completions of a request (raises before queueing any on error)."""
        requests = []
        for index in range(params.n):
            p = child_params(params, index)
            requests.append(
                make_request(
                    "", prompt_token_ids, p, self.eos_token_ids,
                    cache_salt=cache_salt, priority=priority, lora=lora,
                )
            )
        ids = self.processor.add_request(request_id, prompt_token_ids, params)
        try:
            for request, child_id in zip(requests, ids, strict=True):
                request.request_id = child_id
                self.core.add_request(request)
        except Exception:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        self.core.abort(self.processor.remove(request_id))

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.processor.process(self.core.step())
        for child_id, stop in stopped:
            self.core.finish_with_stop_string(child_id, stop)
        return outputs
