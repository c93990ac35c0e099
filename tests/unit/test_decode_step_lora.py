"""LoRA rows in the one-op decode step (kernels/decode_step.cpp): rows of different
adapters and of none in one op compute what the eager model with the bank's delta does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_decode_step import (
    _attention,
    _decode_meta,
    _model,
    _op_and_eager,
    _tail_meta,
)
from tokenyard.bench.lora_adapters import write_adapters
from tokenyard.engine.kernels.blocks import kernel_available
from tokenyard.engine.kernels.build import unavailable_reason
from tokenyard.engine.llm import LLM
from tokenyard.engine.lora.adapter import FUSED, LoraAdapter, LoraPart
from tokenyard.engine.lora.bank import LoraBank, out_sizes
from tokenyard.engine.models.decode_step import DecodeStep
from tokenyard.engine.models.llama import LlamaForCausalLM
from tokenyard.engine.paged_attention import as_decode_rows
from tokenyard.wire.sampling_params import SamplingParams

MAX_RANK = 4


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not kernel_available():
        pytest.skip(f"quant_matmul kernel unavailable: {unavailable_reason('quant_matmul')}")


def _adapter(model: LlamaForCausalLM, name: str, rank: int, projections: list[str],
             seed: int) -> LoraAdapter:
    """Random A and B (B nonzero) of `rank` on `projections` of every layer."""
    gen = torch.Generator().manual_seed(seed)
    adapter = LoraAdapter(name, rank, Path(name))
    for index, layer in enumerate(model.layers):
        for proj in projections:
            fused, part = FUSED[proj]
            linear = getattr(layer, fused)
            size = out_sizes(layer, fused, linear.out_features)[part]
            a = torch.randn(rank, linear.in_features, generator=gen) * 0.1
            b = torch.randn(size, rank, generator=gen) * 0.1
            adapter.parts.setdefault((index, fused), []).append(LoraPart(part, a, b))
    return adapter


def _bank(model: LlamaForCausalLM) -> LoraBank:
    """Two adapters in slots 1 and 2: every projection at the full rank, and q/v at a
    smaller one (its other ranks and slices zero)."""
    bank = LoraBank(model, max_loras=3, max_rank=MAX_RANK, device=torch.device("cpu"))
    bank.load(_adapter(model, "all", MAX_RANK, list(FUSED), seed=5))
    bank.load(_adapter(model, "qv", 2, ["q_proj", "v_proj"], seed=6))
    return bank


@pytest.mark.parametrize("tail", [False, True], ids=["decode", "tail"])
def test_adapted_rows_in_the_op_match_the_eager_layers(tail: bool) -> None:
    model = _model(3, "q4_1")
    step, fused, eager, gen = _op_and_eager(model, 7)
    bank = _bank(model)
    if tail:  # two decode rows, then a prompt tail of 4 over its cached prefix
        meta, positions = _tail_meta(21, 4, gen, (3, 17))
        rows = as_decode_rows(meta, positions)
        slots = torch.tensor([2, 0, 1, 1, 1, 1])
    else:
        lens = [1, 7, 13, 30, 9]
        rows = meta = _decode_meta(lens, gen)
        positions = torch.tensor(lens) - 1
        slots = torch.tensor([0, 1, 2, 1, 2])
    assert rows is not None
    ids = torch.randint(0, 512, (len(positions),), generator=gen)

    eager.metadata = meta
    bank.rows.set(slots)
    expected = model(ids, positions, eager)
    got = step(ids, positions, rows, slots)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    for mine, theirs in ((fused.k_cache, eager.k_cache), (fused.v_cache, eager.v_cache)):
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-3)
    bank.rows.set(None)
    plain = model(ids, positions, eager)  # (its k/v over the adapted ones: compared above)
    adapted = (slots > 0).nonzero().flatten()
    base = (slots == 0).nonzero().flatten()
    torch.testing.assert_close(got[base], plain[base], rtol=1e-3, atol=1e-3)
    assert (got[adapted] - plain[adapted]).abs().max() > 0.05  # the adapters matter


def test_op_refuses_a_slot_outside_the_bank() -> None:
    model = _model(3, "q4_1")
    step = DecodeStep.build(model, _attention(model))
    if step is None:
        pytest.skip("decode kernels unavailable")
    _bank(model)
    meta = _decode_meta([5], torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="LoRA slot out of range"):
        step(torch.tensor([3]), torch.tensor([4]), meta, torch.tensor([4]))


def test_embedded_model_with_adapters_keeps_the_op_and_the_eager_tokens(
        embedded_gguf_path: object, tmp_path: Path) -> None:
    folders = write_adapters(tmp_path, 2)
    llm = LLM(str(embedded_gguf_path), max_loras=2, max_lora_rank=8,
              lora_modules=",".join(f"{n}={p}" for n, p in folders.items()))
    runner = llm.core.runner
    step = runner.decode_step
    if step is None:
        pytest.skip("the decode step op is unavailable here")
    adapted_calls = []

    def counted(*args: object) -> torch.Tensor:
        adapted_calls.append(args[3] is not None)
        return step(*args)

    prompts = [[{"role": "user", "content": "Write a haiku about rain."}]] * 4
    loras: list[str | None] = [None, "a0", "a1", "a0"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runner.decode_step = counted
    try:
        fused = [r.token_ids for r in llm.generate(prompts, params, loras=loras,
                                                   cache_salt="fused")]
        runner.decode_step = None
        eager = [r.token_ids for r in llm.generate(prompts, params, loras=loras,
                                                   cache_salt="eager")]
    finally:
        runner.decode_step = step
    assert fused == eager
    assert fused[1] != fused[0] and fused[2] != fused[1] and fused[3] == fused[1]
    assert sum(adapted_calls) >= 14  # the decode steps of the adapted rows ran in the op
