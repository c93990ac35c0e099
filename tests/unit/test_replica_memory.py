"""The replica's memory follows what it uses: a lazily backed KV pool, freed load memory."""

from __future__ import annotations

import torch

from tokenyard.engine.frontend import release_freed_memory
from tokenyard.engine.paged_attention import PagedAttention, lazy_zeros, resident_bytes

MIB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_kv_pool_is_resident_only_where_written() -> None:
    # 2 x 64 MiB: with torch.zeros every page would be resident from the start.
    attn = PagedAttention(num_layers=4, num_blocks=1024, block_size=16, num_kv_heads=4,
                          head_dim=64, use_kernel=False)
    assert attn.nbytes == 128 * MIB
    assert attn.resident_bytes() < 4 * MIB
    assert not attn.k_cache[:, :8].any() and not attn.v_cache[:, -8:].any()  # reads zeros
    assert attn.resident_bytes() < 4 * MIB  # reading never-written slots backs nothing
    attn.k_cache[2, 100].fill_(1.5)
    attn.v_cache[3, 900].fill_(-2.0)
    assert 0 < attn.resident_bytes() < 4 * MIB
    assert float(attn.k_cache[2, 100].sum()) == 1.5 * 16 * 4 * 64
    assert float(attn.k_cache.sum()) == 1.5 * 16 * 4 * 64  # nothing else changed


def test_lazy_zeros_outlive_their_mapping_reference() -> None:
    t = lazy_zeros((3, 1000), torch.float32, "cpu")
    assert t.shape == (3, 1000) and t.is_contiguous() and not t.any()
    t += 2.0  # the mapping stays alive with the tensor
    assert float(t.sum()) == 6000.0
    assert resident_bytes(t) >= 4096
    assert lazy_zeros((0, 4), torch.float32, "cpu").numel() == 0


def test_freed_heap_memory_goes_back_to_the_kernel() -> None:
    # Chunks below glibc's mmap threshold come from the heap; keeping every other one
    # alive stops the heap from shrinking on its own, as the freed float32 layers did.
    chunks = [torch.ones(8 * 1024) for _ in range(4000)]  # 32 KiB each, ~125 MiB
    kept = chunks[::2]
    del chunks
    before = _rss()
    release_freed_memory()
    assert before - _rss() > 30 * MIB
    assert all(float(c[0]) == 1.0 for c in kept)
