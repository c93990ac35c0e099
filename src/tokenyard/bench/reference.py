"""transformers on the same weights: the reference for correctness tests and benchmarks.

transformers is a development dependency only; nothing at serving time imports this.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from tokenyard.engine.models.config import ModelConfig


def transformers_config(config: ModelConfig) -> Any:
    """The transformers config class instance equivalent to `config` (float32, eager)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope = {**config.rope_scaling, "rope_theta": config.rope_theta}
        rope.setdefault("rope_type", rope.pop("type", "default"))
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=rope,
        attn_implementation="eager",
        torch_dtype=torch.float32,
    )
    if config.architecture == "llama":
        kwargs["attention_bias"] = config.attention_bias
    return classes[config.architecture](**kwargs)


def transformers_model(config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> Any:
    """transformers' own model class for `config`, holding `weights` (HF names)."""
    import transformers

    hf_config = transformers_config(config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"weights do not fit transformers: missing {missing}, "
                         f"unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@torch.inference_mode()
def greedy_continuation(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate (with its KV cache), new tokens only."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0, eos_token_id=None,
    )
    return [int(t) for t in out[0, len(prompt_ids):]]


def transformers_figures(
    llm: Any, prompts: list[list[int]], short: list[int], long: list[int],
    args: argparse.Namespace,
) -> list[Any]:
    """transformers float32 on the same weights: one sequence, a batch of 16, a long prompt."""
    from tokenyard.bench.host import Figure
    from tokenyard.engine.models.loader import load_model

    loaded = load_model(llm.frontend.config.model, llm.frontend.config.cache_dir,
                        show_progress=False)
    model = transformers_model(loaded.config, loaded.weights)
    out_len = args.output_len

    def one() -> float:
        start = time.perf_counter()
        greedy_continuation(model, short, out_len)
        return out_len / (time.perf_counter() - start)

    def batch16() -> float:
        group = [p[:min(len(p), 200)] for p in prompts[:16]]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=out_len, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
        return 16 * out_len / (time.perf_counter() - start)

    def ttft() -> float:
        start = time.perf_counter()
        greedy_continuation(model, long, 1)
        return time.perf_counter() - start

    repeats = max(1, args.repeats - 1)
    return [
        Figure("transformers fp32: one sequence (same prompt, same weights)",
               statistics.median(one() for _ in range(repeats)), "tok/s"),
        Figure("transformers fp32: batch of 16 (prompts cut to 200 tokens, left-padded)",
               statistics.median(batch16() for _ in range(repeats)), "output tok/s"),
        Figure(f"transformers fp32: {len(long)}-token prompt, time to first token",
               statistics.median(ttft() for _ in range(repeats)), "s"),
    ]
