"""The CUDA path (bfloat16). Skips without a GPU; CI has none."""

from __future__ import annotations

import pytest
import torch

from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU"),
]


def test_cuda_engine_agrees_with_the_cpu_engine() -> None:
    # A prompt whose first tokens are far from a tie: under SmolLM2's default system
    # prompt, "What is the capital of France?" starts with "The" (-1.88) against "L"
    # (-1.96) in float32, a gap that bf16's rounding closes (measured on an H100).
    prompt = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    cpu = LLM(device="cpu", weights="float32").generate(prompt, params)[0]
    gpu_llm = LLM(device="cuda")
    assert gpu_llm.frontend.weights == "float32"  # `auto` on CUDA: bf16 from float32
    gpu = gpu_llm.generate(prompt, params)[0]
    assert gpu.token_ids[:3] == cpu.token_ids[:3]  # bf16 may flip a later near-tie
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    assert (gpu_llm.generate(prompt, seeded)[0].token_ids
            == gpu_llm.generate(prompt, seeded)[0].token_ids)
    stats = gpu_llm.core.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_cuda_graphs_replay_the_eager_engines_tokens() -> None:
    """`--cuda-graphs on` (engine/cuda_graphs.py): captured at start, then every pure decode
    step of a batch of 3 replays a graph of 4 rows; greedy tokens and logprobs are the
    eager engine's. Written without a GPU: the first device run tells."""
    prompts = [[{"role": "user", "content": text}] for text in (
        "Count from 1 to 10, separated by commas.", "Name three colours.",
        "Write the alphabet.")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    eager = LLM(device="cuda").generate(prompts, params)
    graphed_llm = LLM(device="cuda", cuda_graphs=True)
    runner = graphed_llm.core.runner
    assert runner.graphs is not None and 4 in runner.graphs.graphs  # captured
    graphed = graphed_llm.generate(prompts, params)
    for a, b in zip(eager, graphed, strict=True):
        assert a.token_ids == b.token_ids
    stats = graphed_llm.core.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
