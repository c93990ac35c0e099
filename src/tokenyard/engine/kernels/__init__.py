"""Optional C++ CPU kernels, compiled on first use (never at import time).

Every kernel has a torch fallback: when one cannot be built (no compiler, a build error,
`TOKENYARD_DISABLE_KERNELS=1`) the engine uses the fallback and logs why once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from tokenyard.engine.kernels.build import kernels_disabled, load_kernel, unavailable_reason

__all__ = [
    "PagedDecodeFn",
    "kernels_disabled",
    "load_paged_decode",
    "unavailable_reason",
]


class PagedDecodeFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        tail: int = 1,
    ) -> torch.Tensor: ...


def load_paged_decode(cache_dir: Path | None = None) -> PagedDecodeFn | None:
    """The paged decode attention op, or None when the kernel is unavailable.

    out[N, H, D] = softmax(scale * q k^T) v over each row's first
    context_lens[i] cached tokens, addressed through block_tables [N, max_blocks].
    With `tail` = t > 1 each row holds t consecutive query positions, heads ordered
    [kv head][position][query group], the last at context_lens[i] (causal within them).
    """
    if cache_dir is None:
        from tokenyard.config import default_cache_dir

        cache_dir = default_cache_dir()
    module = load_kernel("paged_decode", cache_dir)
    if module is None:
        return None
    fn: PagedDecodeFn = module.paged_decode
    return fn
