"""The Triton paged decode attention (`engine/kernels/triton_decode.py`), run on the CPU by
Triton's interpreter: the code a CUDA replica runs, against a gather-and-mask reference
and against `PagedAttention`'s own torch path, and the start-up check that keeps a kernel
that fails it out of the engine. Its speed on a GPU is not measured here."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

from tests.conftest import require_service
from tests.unit.block_tables import scattered_tables
from tokenyard.engine.kernels import triton_decode
from tokenyard.engine.paged_attention import AttentionMetadata, PagedAttention


@pytest.fixture(autouse=True)
def _triton() -> None:
    require_service("Triton", importlib.util.find_spec("triton") is not None,
                    "it is not installed (the dev extra pins it)")
    if not os.path.exists("/dev/nvidiactl"):  # tests/conftest.py set the interpreter on
        assert os.environ.get("TRITON_INTERPRET") == "1"


def _case(heads: int, kv_heads: int, dim: int, lens: list[int], dtype: torch.dtype,
          seed: int = 0, block_size: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    blocks = len(lens) * width + 3
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = scattered_tables(lens, blocks, block_size, gen)
    # A slice of a wider batch, as the engine passes q[:num_decodes].
    q = torch.randn(len(lens) + 2, heads, dim, generator=gen).to(dtype)[: len(lens)]
    return q, k, v, tables, torch.tensor(lens)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 32, 64), (32, 8, 128),
                                                (4, 1, 80)],
                         ids=["smollm2", "1.7b-mha", "8b-gqa", "odd-dim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
def test_decode_rows_match_the_reference(heads: int, kv_heads: int, dim: int,
                                         dtype: torch.dtype) -> None:
    q, k, v, tables, lens = _case(heads, kv_heads, dim, [1, 17, 64, 130], dtype)
    got = triton_decode.paged_decode(q, k, v, tables, lens, dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    want = triton_decode.reference(q, k, v, tables, lens, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((got.float() - want).abs().max()) < tolerance


@pytest.mark.parametrize("tail", [2, 3])
def test_a_tail_of_query_positions_is_causal_within_it(tail: int) -> None:
    """Rows that fold `tail` consecutive positions into the query group (a prompt's tail
    over a cached prefix): each position sees the keys up to itself."""
    q, k, v, tables, lens = _case(12, 2, 64, [40, 97], torch.float32, seed=3)
    got = triton_decode.paged_decode(q, k, v, tables, lens, 0.125, tail=tail)
    want = triton_decode.reference(q, k, v, tables, lens, 0.125, tail=tail)
    assert float((got - want).abs().max()) < 1e-5
    # The reference is causal: the first position of a row differs from its last.
    plain = triton_decode.reference(q, k, v, tables, lens, 0.125)
    assert float((want - plain).abs().max()) > 1e-3


def test_paged_attention_answers_the_same_through_the_kernel_as_through_torch() -> None:
    """The engine's contract: the kernel in `PagedAttention.decode_kernel` with context
    lengths gives what the torch path gives with its additive mask."""
    layers, blocks, size, kv_heads, dim, heads = 2, 24, 16, 3, 64, 9
    lens = [5, 33, 80]
    q, k, v, tables, ctx = _case(heads, kv_heads, dim, lens, torch.float32, seed=5)
    outs = []
    for kernel in (None, triton_decode.paged_decode):
        attention = PagedAttention(layers, blocks, size, kv_heads, dim, use_kernel=False)
        attention.k_cache[1, : k.shape[0]] = k
        attention.v_cache[1, : v.shape[0]] = v
        attention.decode_kernel = kernel
        slots = torch.tensor([int(tables[i, (n - 1) // size]) * size + (n - 1) % size
                              for i, n in enumerate(lens)])
        keys = torch.arange(tables.shape[1] * size)
        mask = torch.zeros(len(lens), keys.numel()).masked_fill_(
            keys[None, :] >= ctx[:, None], float("-inf"))[:, None, None, :]
        attention.metadata = AttentionMetadata(
            slot_mapping=slots, num_decodes=len(lens), decode_block_tables=tables,
            decode_mask=None if kernel else mask, prefills=[],
            decode_context_lens=ctx if kernel else None)
        # The new token's k/v are the ones already at its slot: the write is a no-op.
        flat_k, flat_v = k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
        outs.append(attention(1, q.contiguous(), flat_k[slots], flat_v[slots]))
    assert float((outs[0] - outs[1]).abs().max()) < 1e-5


def test_the_start_check_admits_a_kernel_that_agrees_and_refuses_one_that_does_not(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    assert triton_decode.load_triton_paged_decode(cpu) is triton_decode.paged_decode

    def wrong(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return torch.zeros_like(q)

    monkeypatch.setattr(triton_decode, "paged_decode", wrong)
    with caplog.at_level(logging.WARNING, logger=triton_decode.__name__):
        assert triton_decode.load_triton_paged_decode(cpu) is None
    assert "failed its check" in caplog.text
    monkeypatch.undo()  # the kernel that agrees, turned off by the operator's switch
    monkeypatch.setenv("TOKENYARD_DISABLE_KERNELS", "1")
    assert triton_decode.load_triton_paged_decode(cpu) is None
