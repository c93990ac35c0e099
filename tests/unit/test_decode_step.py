"""The one-op decode step (kernels/decode_step.cpp) against the eager model it replaces."""

from __future__ import annotations

import pytest
import torch

from tokenyard.engine.kernels.blocks import kernel_available
from tokenyard.engine.kernels.build import unavailable_reason
from tokenyard.engine.llm import LLM
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.decode_step import DecodeStep
from tokenyard.engine.models.llama import LlamaForCausalLM
from tokenyard.engine.models.quant import quantize_blocks
from tokenyard.engine.paged_attention import (
    ONE_OP_TAIL_ROWS,
    AttentionMetadata,
    PagedAttention,
    PrefillSpan,
    as_decode_rows,
)
from tokenyard.wire.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not kernel_available():
        pytest.skip(f"quant_matmul kernel unavailable: {unavailable_reason('quant_matmul')}")


def _model(seed: int, weights: str, **switches: bool) -> LlamaForCausalLM:
    """A tiny random model (2 layers, head_dim 32) in block weights."""
    cfg = ModelConfig(architecture="qwen3" if switches.get("qk_norm") else "llama",
                      vocab_size=512, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=128, **switches)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
    return quantize_blocks(model, weights, from_gguf=weights == "q8_0")


def _attention(model: LlamaForCausalLM) -> PagedAttention:
    cfg = model.config
    return PagedAttention(cfg.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE,
                          cfg.num_key_value_heads, cfg.head_dim)


def _op_and_eager(model: LlamaForCausalLM, seed: int
                  ) -> tuple[DecodeStep, PagedAttention, PagedAttention, torch.Generator]:
    """The model's op over one cache and the eager layers' cache, both holding the same
    random k/v of earlier tokens; and the generator that drew them, for the rest."""
    eager, fused = _attention(model), _attention(model)
    if eager.decode_kernel is None:
        pytest.skip("paged decode kernel unavailable")
    step = DecodeStep.build(model, fused)
    assert step is not None, unavailable_reason("decode_step")
    gen = torch.Generator().manual_seed(seed)
    fused.k_cache.copy_(torch.randn(eager.k_cache.shape, generator=gen))
    fused.v_cache.copy_(torch.randn(eager.v_cache.shape, generator=gen))
    eager.k_cache.copy_(fused.k_cache)
    eager.v_cache.copy_(fused.v_cache)
    return step, fused, eager, gen


def _decode_meta(lens: list[int], gen: torch.Generator) -> AttentionMetadata:
    """Rows with contexts of `lens` tokens (this step's included) in scattered blocks."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    tables, slots, used = [], [], 0
    for n in lens:
        need = -(-n // BLOCK_SIZE)
        row = perm[used:used + need]
        used += need
        slots.append(row[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
        tables.append(row + [0] * (width - need))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decodes=len(lens),
        decode_block_tables=torch.tensor(tables), decode_mask=None, prefills=[],
        decode_context_lens=torch.tensor(lens),
    )


@pytest.mark.parametrize(("weights", "switches"), [
    ("q4_1", {}),
    ("q8_0", {"tie_word_embeddings": True}),
    ("q4_1", {"attention_bias": True, "o_proj_bias": True}),
    ("q8_0", {"qk_norm": True}),
])
def test_one_op_step_matches_the_eager_layers(weights: str, switches: dict[str, bool]) -> None:
    model = _model(0, weights, **switches)
    # Earlier tokens' k/v already cached, the same in both.
    step, fused, eager, gen = _op_and_eager(model, 1)
    lens = [1, 7, 13, 30]
    meta = _decode_meta(lens, gen)
    ids = torch.randint(0, 512, (len(lens),), generator=gen)
    positions = torch.tensor(lens) - 1

    eager.metadata = meta
    expected = model(ids, positions, eager)
    got = step(ids, positions, meta)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    # The first layer's k/v see the same inputs; later layers' inputs differ by rounding
    # (RMSNorm sums in another order), which can move an int16 activation by one step.
    for mine, theirs in ((fused.k_cache, eager.k_cache), (fused.v_cache, eager.v_cache)):
        torch.testing.assert_close(mine[0], theirs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(model.compute_logits(got), model.compute_logits(expected),
                               rtol=1e-3, atol=1e-3)


def test_no_step_for_float32_weights() -> None:
    model = LlamaForCausalLM(_model(0, "q4_1").config)  # float32, never converted
    assert DecodeStep.build(model, _attention(model)) is None


def test_op_refuses_a_slot_outside_the_cache() -> None:
    model = _model(0, "q4_1")
    attention = _attention(model)
    step = DecodeStep.build(model, attention)
    if step is None:
        pytest.skip("decode kernels unavailable")
    meta = _decode_meta([5], torch.Generator().manual_seed(0))
    meta.slot_mapping = torch.tensor([NUM_BLOCKS * BLOCK_SIZE])
    with pytest.raises(RuntimeError, match="slot out of range"):
        step(torch.tensor([3]), torch.tensor([4]), meta)


def test_embedded_model_greedy_tokens_are_the_eager_paths(embedded_gguf_path: object) -> None:
    llm = LLM(str(embedded_gguf_path))
    runner = llm.core.runner
    if runner.decode_step is None:
        pytest.skip("the decode step op is unavailable here")
    prompts = [[{"role": "user", "content": text}] for text in
               ("What is the capital of France?", "Write a haiku about rain.",
                "List three prime numbers.")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fused = [r.token_ids for r in llm.generate(prompts, params)]
    step, runner.decode_step = runner.decode_step, None
    try:
        eager = [r.token_ids for r in llm.generate(prompts, params)]
    finally:
        runner.decode_step = step
    assert fused == eager


def _tail_meta(cached: int, rows: int, gen: torch.Generator,
               decode_lens: tuple[int, ...] = ()) -> tuple[AttentionMetadata, torch.Tensor]:
    """A step of decode rows (contexts of `decode_lens`) then one sequence's last `rows`
    prompt tokens over its `cached` cached ones, in scattered blocks; with the positions."""
    meta = _decode_meta(list(decode_lens), gen) if decode_lens else AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=0,
        decode_block_tables=None, decode_mask=None, prefills=[])
    used = {int(b) for b in meta.decode_block_tables.flatten()} if decode_lens else set()
    free = [b for b in torch.randperm(NUM_BLOCKS, generator=gen).tolist() if b not in used]
    ctx = cached + rows
    table = torch.tensor(free[: -(-ctx // BLOCK_SIZE)])
    pos = torch.arange(cached, ctx)
    meta.slot_mapping = torch.cat([meta.slot_mapping,
                                   table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE])
    meta.prefills = [PrefillSpan(start=len(decode_lens), num_tokens=rows, context_len=ctx,
                                 block_table=table)]
    positions = torch.cat([torch.tensor(decode_lens, dtype=torch.long) - 1, pos])
    return meta, positions


@pytest.mark.parametrize(("rows", "decode_lens"), [(8, ()), (5, ()), (2, ()), (6, (3, 17))])
def test_a_prompt_tail_over_its_cached_prefix_matches_the_eager_layers(
    rows: int, decode_lens: tuple[int, ...]
) -> None:
    """A prefix-cache hit's tail as rows of the op (each token its own context length;
    consecutive rows attended as folded chunks), beside decode rows or alone, against the
    eager model with the paged kernel over the span."""
    model = _model(2, "q4_1")
    step, fused, eager, gen = _op_and_eager(model, rows)
    meta, positions = _tail_meta(37, rows, gen, decode_lens)
    ids = torch.randint(0, 512, (len(positions),), generator=gen)
    as_rows = as_decode_rows(meta, positions)
    assert as_rows is not None and as_rows.num_decodes == len(positions)
    assert as_rows.decode_context_lens.tolist() == (positions + 1).tolist()

    eager.metadata = meta
    expected = model(ids, positions, eager)
    got = step(ids, positions, as_rows)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    for mine, theirs in ((fused.k_cache, eager.k_cache), (fused.v_cache, eager.v_cache)):
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-3)


def test_only_short_tails_over_a_cached_prefix_become_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    meta, positions = _tail_meta(10, ONE_OP_TAIL_ROWS + 1, gen)
    assert as_decode_rows(meta, positions) is None  # too long: the eager path
    meta, positions = _tail_meta(10, 4, gen)
    meta.prefills[0].block_table = None  # nothing cached before: a whole prompt
    assert as_decode_rows(meta, positions) is None


def test_embedded_model_prefix_hit_gives_the_uncached_greedy_tokens(
    embedded_gguf_path: object,
) -> None:
    """The same chat prompt again (its prefix cached, its tail through the op) generates the
    tokens it generated uncached, and those of the eager path over the cached prefix."""
    llm = LLM(str(embedded_gguf_path))
    runner = llm.core.runner
    if runner.decode_step is None:
        pytest.skip("the decode step op is unavailable here")
    prompt = [{"role": "user", "content": " ".join(["the river and the stone"] * 30)}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cold = llm.generate(prompt, params)[0]
    hit = llm.generate(prompt, params)[0]
    assert hit.num_cached_tokens > 0
    step, runner.decode_step = runner.decode_step, None
    try:
        eager = llm.generate(prompt, params)[0]
    finally:
        runner.decode_step = step
    assert hit.completions[0].token_ids == cold.completions[0].token_ids
    assert eager.completions[0].token_ids == cold.completions[0].token_ids
