"""A float16 KV pool under the float32 model (`--kv-cache-dtype float16`): half the bytes a
token, keys and values rounded once when written, the same greedy text as the float32 pool
but for rare late divergences, through the fused decode op, the prefix cache and the
prefill-tail kernel."""

from __future__ import annotations

import argparse

import pytest
import torch

from tokenyard.bench.offline import agreement_prompts, greedy
from tokenyard.config import EngineConfig
from tokenyard.engine.core import kv_block_bytes
from tokenyard.engine.llm import LLM
from tokenyard.engine_args import add_engine_args, engine_kwargs

GIB = 0.05  # a small pool: both fit easily, and their resident bytes compare


@pytest.fixture(scope="module")
def pools() -> tuple[LLM, LLM]:
    return LLM(kv_cache_gib=GIB), LLM(kv_cache_gib=GIB, kv_cache_dtype="float16")


def test_the_pool_holds_float16_and_twice_the_tokens(pools: tuple[LLM, LLM]) -> None:
    f32, f16 = pools
    a32, a16 = f32.core.runner.attention, f16.core.runner.attention
    assert a32.k_cache.dtype == torch.float32 and a16.k_cache.dtype == torch.float16
    block16 = kv_block_bytes(f16.core.model_config, 16, torch.float16)
    assert block16 * 2 == kv_block_bytes(f16.core.model_config, 16, torch.float32)
    assert f16.core.kv.num_blocks == int(GIB * 2**30) // block16
    assert f16.core.kv.num_blocks in (2 * f32.core.kv.num_blocks, 2 * f32.core.kv.num_blocks + 1)
    # The float32 model's fused decode op and the paged kernel both take the float16 pool.
    assert f16.core.runner.decode_step is not None
    assert a16.decode_kernel is not None


def test_greedy_text_agrees_with_the_float32_pool(pools: tuple[LLM, LLM]) -> None:
    f32, f16 = pools
    prompts = agreement_prompts(8)
    a = f32.generate(prompts, greedy(32))
    b = f16.generate(prompts, greedy(32))
    agreed = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < 32 and x.token_ids[n] == y.token_ids[n]:
            n += 1
        agreed.append(n / 32)
    assert sum(agreed) / len(agreed) >= 0.9, agreed
    # A written-then-read pool: the resident bytes follow the tokens, at half the size.
    r32, r16 = (llm.core.runner.attention.resident_bytes() for llm in pools)
    assert 0 < r16 < 0.6 * r32


def test_a_prefix_hit_over_a_float16_pool_repeats_the_uncached_answer(
    pools: tuple[LLM, LLM],
) -> None:
    """A long prompt twice: the second reuses the first's rounded blocks (the prefill
    tail goes through the paged kernel), with the same greedy tokens, and no block leaks."""
    _, f16 = pools
    prompt = [{"role": "user", "content": "Summarise: " + "the quick brown fox " * 60}]
    first = f16.generate(prompt, greedy(16))[0]
    second = f16.generate(prompt, greedy(16))[0]
    assert second.num_cached_tokens >= 16 * 10
    assert second.token_ids == first.token_ids
    stats = f16.core.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_an_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_env(kv_cache_dtype="int4")


def test_serve_passes_the_flag_to_its_replicas_and_the_env_sets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--kv-cache-dtype` is an engine flag of `serve` and `engine` (the operator's, never
    a request's): parsed, it reaches the replica's EngineConfig; TOKENYARD_KV_CACHE_DTYPE
    is its default; a value outside the choices is an argparse error."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-cache-dtype", "float16"]))
    assert kwargs == {"kv_cache_dtype": "float16"}
    assert EngineConfig.from_env(**kwargs).kv_cache_dtype == "float16"
    monkeypatch.setenv("TOKENYARD_KV_CACHE_DTYPE", "float16")
    assert EngineConfig.from_env().kv_cache_dtype == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
