"""The C++ paged decode kernel against the torch gather + SDPA path."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.unit.block_tables import scattered_tables
from tokenyard.config import default_cache_dir
from tokenyard.engine.kernels import PagedDecodeFn, load_paged_decode
from tokenyard.engine.kernels.build import load_kernel, unavailable_reason
from tokenyard.engine.paged_attention import (
    KERNEL_TAIL_ROWS,
    AttentionMetadata,
    PagedAttention,
    PrefillSpan,
    _gather_blocks,
)

BLOCK_SIZE = 16
HEAD_DIM = 64
NUM_KV_HEADS = 3
NUM_BLOCKS = 512


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeFn:
    fn = load_paged_decode()
    if fn is None:
        pytest.skip(f"paged_decode kernel unavailable: {unavailable_reason('paged_decode')}")
    return fn


def _tables(lens: list[int], gen: torch.Generator) -> torch.Tensor:
    """Scattered (non-contiguous, shuffled) blocks per row, padded with 0."""
    return scattered_tables(lens, NUM_BLOCKS, BLOCK_SIZE, gen)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """The torch path of PagedAttention: gather the blocks, one SDPA with a padding mask."""
    nd, num_heads, head_dim = q.shape
    kvh = k.shape[2]
    qd = q.view(nd, kvh, num_heads // kvh, head_dim)
    kd = _gather_blocks(k, table, q.dtype).transpose(1, 2)
    vd = _gather_blocks(v, table, q.dtype).transpose(1, 2)
    visible = torch.arange(table.shape[1] * BLOCK_SIZE)[None, :] < lens[:, None]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
    return od.reshape(nd, num_heads, head_dim)


def _case(batch: int, groups: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    base = [1, 15, 16, 17, 300]
    lens = [base[i % len(base)] for i in range(batch)]
    if batch > len(base):  # the rest: random lengths
        lens[len(base):] = torch.randint(1, 320, (batch - len(base),), generator=gen).tolist()
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    q = torch.randn(batch, NUM_KV_HEADS * groups, HEAD_DIM, generator=gen) * 2
    table = _tables(lens, gen)
    return q, k, v, table, torch.tensor(lens, dtype=torch.long)


def _decode_step(table: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs: each row's new token goes to its last context position
    (its slot), new random k/v, and the torch path's padding mask."""
    batch, last = len(lens), lens - 1
    slots = table.gather(1, (last // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + last % BLOCK_SIZE
    new_k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM)
    new_v = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM)
    visible = torch.arange(table.shape[1] * BLOCK_SIZE)[None, :] < lens[:, None]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    return slots, new_k, new_v, mask


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("batch", [1, 5, 37])
def test_kernel_matches_torch_path(kernel: PagedDecodeFn, batch: int, groups: int) -> None:
    q, k, v, table, lens = _case(batch, groups, seed=batch * 10 + groups)
    out = kernel(q, k, v, table, lens, 1 / math.sqrt(HEAD_DIM))
    ref = _reference(q, k, v, table, lens)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 12])
def test_a_float16_cache_reads_as_its_float32_values(kernel: PagedDecodeFn,
                                                      head_dim: int) -> None:
    """A float16 cache: the same output as the float32 cache of the same (rounded) values;
    a head_dim of 12 runs the scalar tails (the portable half -> float conversion)."""
    q, k, v, table, lens = _case(37, 3, seed=21)
    q, k, v = q[..., :head_dim], k[..., :head_dim], v[..., :head_dim]
    kh, vh = k.contiguous().half(), v.contiguous().half()
    out = kernel(q, kh, vh, table, lens, 1 / math.sqrt(head_dim))
    ref = _reference(q.contiguous(), kh.float(), vh.float(), table, lens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_the_portable_half_conversions_equal_torchs() -> None:
    """float <-> binary16 without F16C: bit for bit what torch does, on normals,
    subnormals, ties, overflow, zeros and infinities."""
    module = load_kernel("paged_decode", default_cache_dir())
    if module is None:
        pytest.skip(f"paged_decode kernel unavailable: {unavailable_reason('paged_decode')}")
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6,
                            6.1035156e-05, 5.9604645e-08, 2.9802322e-08, 2.98e-08, 1e-9,
                            float("inf"), float("-inf"), 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11])
    x = torch.cat([special, torch.randn(20_000, generator=gen) * 10.0 ** torch.randint(
        -9, 6, (20_000,), generator=gen)])
    bits = module.to_half_bits(x)
    assert torch.equal(bits, x.half().view(torch.int16))
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    finite = ~torch.isnan(every.view(torch.float16))
    back = module.from_half_bits(every)
    assert torch.equal(back[finite], every.view(torch.float16).float()[finite])
    assert torch.isnan(back[~finite]).all()


def test_kernel_single_lengths(kernel: PagedDecodeFn) -> None:
    """Each edge length alone (a batch of one row of that length)."""
    for n in (1, 15, 16, 17, 300):
        q, k, v, _, _ = _case(1, 3, seed=n)
        gen = torch.Generator().manual_seed(n)
        table, lens = _tables([n], gen), torch.tensor([n])
        out = kernel(q, k, v, table, lens, 1 / math.sqrt(HEAD_DIM))
        torch.testing.assert_close(out, _reference(q, k, v, table, lens), atol=1e-5, rtol=1e-5)


def test_kernel_non_contiguous_query(kernel: PagedDecodeFn) -> None:
    q, k, v, table, lens = _case(37, 3, seed=7)
    q_strided = torch.cat([q, q], dim=2)[:, :, :HEAD_DIM]  # same values, not contiguous
    assert not q_strided.is_contiguous()
    out = kernel(q_strided, k, v, table, lens, 1 / math.sqrt(HEAD_DIM))
    torch.testing.assert_close(out, _reference(q, k, v, table, lens), atol=1e-5, rtol=1e-5)


def test_kernel_rejects_bad_input(kernel: PagedDecodeFn) -> None:
    q, k, v, table, lens = _case(5, 1, seed=3)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(q, k, v, table, lens + 10_000, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(q.double(), k, v, table, lens, 0.125)


def test_paged_attention_kernel_equals_torch_path(kernel: PagedDecodeFn) -> None:
    """PagedAttention with and without the kernel: same cache, same decode step."""
    groups, batch = 3, 37
    q, k, v, table, lens = _case(batch, groups, seed=11)
    layers = []
    for use_kernel in (True, False):
        att = PagedAttention(
            num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, use_kernel=use_kernel,
        )
        assert (att.decode_kernel is not None) == use_kernel
        att.k_cache[0].copy_(k)
        att.v_cache[0].copy_(v)
        layers.append(att)
    slots, new_k, new_v, mask = _decode_step(table, lens)
    outs = []
    for att in layers:
        att.metadata = AttentionMetadata(
            slot_mapping=slots, num_decodes=batch, decode_block_tables=table,
            decode_mask=None if att.decode_kernel else mask, prefills=[],
            decode_context_lens=lens if att.decode_kernel else None,
        )
        outs.append(att(0, q, new_k, new_v))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_a_float16_pool_under_a_float32_model() -> None:
    """PagedAttention with `cache_dtype` float16: keys and values written rounded, the
    kernel and the torch path (decode and a prefill over the cached prefix) read the same
    values, and the pool takes half the bytes."""
    batch, groups = 9, 3
    q, k, v, table, lens = _case(batch, groups, seed=13)
    slots, new_k, new_v, mask = _decode_step(table, lens)
    outs = []
    for use_kernel in (True, False):
        att = PagedAttention(
            num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, use_kernel=use_kernel,
            cache_dtype=torch.float16,
        )
        assert att.k_cache.dtype == torch.float16
        assert att.nbytes == 2 * NUM_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
        if use_kernel and att.decode_kernel is None:
            pytest.skip(f"paged_decode kernel unavailable: {unavailable_reason('paged_decode')}")
        att.k_cache[0].copy_(k)
        att.v_cache[0].copy_(v)
        att.metadata = AttentionMetadata(
            slot_mapping=slots, num_decodes=batch, decode_block_tables=table,
            decode_mask=None if att.decode_kernel else mask, prefills=[],
            decode_context_lens=lens if att.decode_kernel else None,
        )
        outs.append(att(0, q, new_k, new_v))
        flat = att.k_cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)
        assert torch.equal(flat[slots], new_k.half())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    # The float32 reference over the same values rounded to float16 agrees exactly; over
    # the values themselves, within the rounding's effect.
    full_k, full_v = k.clone(), v.clone()
    full_k.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = new_k
    full_v.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = new_v
    rounded = _reference(q, full_k.half().float(), full_v.half().float(), table, lens)
    torch.testing.assert_close(outs[0], rounded, atol=1e-5, rtol=1e-5)
    exact = _reference(q, full_k, full_v, table, lens)
    assert 0 < (outs[0] - exact).abs().max() < 1e-2


@pytest.mark.parametrize("rows", [1, 5, 6, KERNEL_TAIL_ROWS])
def test_a_prefill_tail_over_a_cached_prefix_equals_the_torch_path(
    kernel: PagedDecodeFn, rows: int
) -> None:
    """A prompt's last rows over its cached prefix (a prefix-cache hit): the kernel with the
    rows folded into the query groups (causal among them; two chunks when even) against
    gather + SDPA with a causal mask, rows not ending on a block boundary."""
    groups, cached = 3, 1000
    gen = torch.Generator().manual_seed(rows)
    ctx = cached + rows
    table = torch.randperm(NUM_BLOCKS, generator=gen)[: -(-ctx // BLOCK_SIZE)]
    k = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(rows, NUM_KV_HEADS * groups, HEAD_DIM, generator=gen)
    new_k = torch.randn(rows, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    new_v = torch.randn(rows, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    pos = torch.arange(cached, ctx)
    slots = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    outs = []
    for use_kernel in (True, False):
        att = PagedAttention(
            num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, use_kernel=use_kernel,
        )
        att.k_cache[0].copy_(k)
        att.v_cache[0].copy_(v)
        att.metadata = AttentionMetadata(
            slot_mapping=slots, num_decodes=0, decode_block_tables=None, decode_mask=None,
            prefills=[PrefillSpan(start=0, num_tokens=rows, context_len=ctx,
                                  block_table=table)],
        )
        outs.append(att(0, q, new_k, new_v))
        if use_kernel:
            assert att.metadata.prefills[0].kernel_rows is not None  # the kernel ran
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_the_kernel_refuses_a_tail_that_does_not_divide_the_group(
    kernel: PagedDecodeFn,
) -> None:
    q, k, v, table, lens = _case(2, 3, seed=5)
    with pytest.raises(RuntimeError, match="tail"):
        kernel(q, k, v, table, lens, 0.125, tail=2)


def test_unavailable_kernel_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENYARD_DISABLE_KERNELS", "1")
    assert load_kernel("no_such_kernel_disabled", tmp_path) is None
    assert "TOKENYARD_DISABLE_KERNELS" in (unavailable_reason("no_such_kernel_disabled") or "")
    monkeypatch.delenv("TOKENYARD_DISABLE_KERNELS")
    assert load_kernel("no_such_kernel_missing", tmp_path) is None
    assert "build failed" in (unavailable_reason("no_such_kernel_missing") or "")
