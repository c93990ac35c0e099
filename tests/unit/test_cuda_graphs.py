"""The CUDA graph runner's static buffers (`engine/cuda_graphs.py`), on the CPU: its
`capture=False` mode runs the forward a graph would record, on the same buffers, so the
copying in, the padding rows and the scratch slot are checked here; the capture and replay
themselves need a GPU (none has run them yet). A tiny random Llama with the C++ paged
decode kernel, the kernel a graph records on CUDA being Triton's with the same contract."""

from __future__ import annotations

import pytest
import torch

from tests.unit.block_tables import scattered_tables
from tokenyard.engine.cuda_graphs import DecodeGraphs
from tokenyard.engine.kernels import load_paged_decode
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.models.llama import LlamaForCausalLM
from tokenyard.engine.paged_attention import AttentionMetadata, PagedAttention

BLOCKS, BLOCK_SIZE, MAX_ROWS, MAX_BLOCKS = 40, 16, 8, 6
SCRATCH = BLOCKS * BLOCK_SIZE  # the first slot of the block past the pool


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, rms_norm_eps=1e-6,
                         architecture="llama", head_dim=16)
    llama = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in llama.parameters():
            p.copy_(0.3 * torch.randn(p.shape))
    return llama.eval()


def _attention() -> PagedAttention:
    kernel = load_paged_decode()
    if kernel is None:
        pytest.skip("the C++ paged decode kernel is unavailable here")
    attention = PagedAttention(2, BLOCKS + 1, BLOCK_SIZE, 2, 16, use_kernel=False)
    attention.decode_kernel = kernel
    gen = torch.Generator().manual_seed(1)
    attention.k_cache.copy_(torch.randn(attention.k_cache.shape, generator=gen))
    attention.v_cache.copy_(torch.randn(attention.v_cache.shape, generator=gen))
    return attention


def _step(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step of rows with `lens` tokens of context (the new one included)."""
    gen = torch.Generator().manual_seed(seed)
    tables = scattered_tables(lens, BLOCKS, BLOCK_SIZE, gen)
    ctx = torch.tensor(lens)
    positions = ctx - 1
    slots = torch.stack([tables[i, int(p) // BLOCK_SIZE] * BLOCK_SIZE + int(p) % BLOCK_SIZE
                         for i, p in enumerate(positions)])
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=len(lens),
                             decode_block_tables=tables, decode_mask=None, prefills=[],
                             decode_context_lens=ctx)
    return torch.randint(0, 256, (len(lens),), generator=gen), positions, meta


def _eager(model: LlamaForCausalLM, attention: PagedAttention, ids: torch.Tensor,
           positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    attention.metadata = meta
    try:
        return model(ids, positions, attention)
    finally:
        attention.metadata = None


@torch.inference_mode()
def test_padded_steps_answer_as_the_eager_model_and_write_only_their_own_slots(
        model: LlamaForCausalLM) -> None:
    graphs_attention, eager_attention = _attention(), _attention()
    graphs = DecodeGraphs(model, graphs_attention, MAX_ROWS, MAX_BLOCKS, SCRATCH,
                          capture=False)
    assert graphs.sizes == [1, 2, 4, 8]
    # A wide step first, so the buffers hold real slots a narrower step must not reuse.
    for seed, lens in enumerate([[5, 40, 17, 80, 33, 2, 64, 16], [9, 50, 3], [70]]):
        ids, positions, meta = _step(lens, seed)
        assert graphs.fits(meta, len(lens))
        got = graphs.run(ids, positions, meta)
        want = _eager(model, eager_attention, ids, positions, meta)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # Every request's keys and values are the eager run's: only the scratch block,
        # past the pool, takes the padding rows' writes (the 3-row step runs as 4).
        for cache in ("k_cache", "v_cache"):
            torch.testing.assert_close(getattr(graphs_attention, cache)[:, :BLOCKS],
                                       getattr(eager_attention, cache)[:, :BLOCKS])
    # The 3-row step ran as 4: its padding row went to the scratch slot.
    assert int(graphs.slots[3]) == SCRATCH and int(graphs.lens[3]) == 1


def test_what_does_not_fit_runs_eagerly(model: LlamaForCausalLM) -> None:
    graphs = DecodeGraphs(model, _attention(), MAX_ROWS, MAX_BLOCKS, SCRATCH,
                          capture=False)
    _, _, meta = _step([5] * (MAX_ROWS + 1), 0)
    assert not graphs.fits(meta, MAX_ROWS + 1)  # more rows than the largest graph
    _, _, meta = _step([MAX_BLOCKS * BLOCK_SIZE + 1], 0)
    assert not graphs.fits(meta, 1)  # a wider block table than the buffers
    _, _, meta = _step([5, 6], 0)
    assert not graphs.fits(meta, 3)  # a prompt row beside the decodes
    masked = AttentionMetadata(meta.slot_mapping, 2, meta.decode_block_tables,
                               torch.zeros(2, 1, 1, 16), [])
    assert not graphs.fits(masked, 2)  # a mask, not context lengths
