"""Block tables for paged-attention tests: each row's blocks scattered over the pool."""

from __future__ import annotations

import torch


def scattered_tables(lens: list[int], num_blocks: int, block_size: int,
                     gen: torch.Generator) -> torch.Tensor:
    """[rows, max blocks] long: row i holds the ceil(lens[i] / block_size) blocks of a
    random permutation of the pool (no two rows share one), padded with block 0 as the
    engine pads."""
    width = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        table[i, :need] = perm[used:used + need]
        used += need
    assert used <= num_blocks
    return table
