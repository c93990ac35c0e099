"""The exponential race that samples a token with probability p: `argmax p_i / E_i`,
with per-row seeded noise in token-id order so a seeded row ignores its batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenyard.engine.sample.metadata import index_tensor

# Block size of the two-level race used by rows without filters.
RACE_BLOCK = 256


def exponential(
    counts: list[int], generators: Sequence[torch.Generator | None], like: torch.Tensor
) -> torch.Tensor:
    """Exponential(1) noise shaped like `like` ``[G, W]``, strictly positive and finite.

    Row ``i`` has ``counts[i]`` real entries. A row with a generator draws exactly that
    many uniforms from it, or none when ``counts[i] == 1`` (nothing to choose), so its
    noise depends on nothing else in the batch; rows without one share a single draw
    from the global RNG. Entries past ``counts[i]`` are arbitrary positive values (the
    caller masks them). ``E = -log(U)`` is used because ``Tensor.exponential_`` is several
    times slower on CPU.
    """
    size, width = like.shape
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == size:
        uniform = torch.rand(size, width, device=like.device)
    else:
        uniform = torch.full((size, width), 0.5, device=like.device)
        if shared:
            widest = max(counts[i] for i in shared)
            draw = torch.rand(len(shared), widest, device=like.device)
            uniform[index_tensor(shared, like.device), :widest] = draw
        for i, generator in enumerate(generators):
            if generator is not None and counts[i] > 1:
                uniform[i, : counts[i]].uniform_(generator=generator)
    # U = 0 would give E = inf; clamping gives a large finite E instead.
    return uniform.clamp_(min=torch.finfo(uniform.dtype).tiny).log_().neg_()


def two_level_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Sample token i of each row with probability ``probs[i] / sum(probs)``; ``[G]``.

    `probs` is ``[G, V]`` of non-negative weights, each row with a positive sum.

    An exponential race run in two rounds so that only ``V / 256 + 256`` noise values per
    row are needed instead of ``V``: first a block of 256 consecutive ids wins with
    probability equal to its mass, then a token of that block wins with probability
    proportional to its own. The product is exactly ``probs``.
    """
    size, vocab = probs.shape
    num_blocks = -(-vocab // RACE_BLOCK)
    pad = num_blocks * RACE_BLOCK - vocab
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(size, num_blocks, RACE_BLOCK)
    mass = blocks.sum(dim=-1)  # [G, num_blocks]
    # One draw per row serves both rounds: the first num_blocks values, then the rest.
    width = num_blocks + RACE_BLOCK
    noise = exponential([width] * size, generators, mass.new_empty(size, width))
    block = (mass / noise[:, :num_blocks]).argmax(dim=-1)
    inside = blocks[torch.arange(size, device=probs.device), block]  # [G, block]
    return block * RACE_BLOCK + (inside / noise[:, num_blocks:]).argmax(dim=-1)
