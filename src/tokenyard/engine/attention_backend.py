"""The contract between a model's attention layers and the engine's KV cache."""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Computes attention for one layer of one flat batch.

    Shapes: q is [T, num_heads, head_dim]; k and v are [T, num_kv_heads, head_dim], where
    T is the number of tokens in the step (all sequences concatenated). The backend writes
    k and v into its cache (if any) and returns [T, num_heads, head_dim]. RoPE has already
    been applied to q and k.
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class CausalAttention:
    """Cache-free causal attention over a single sequence (tests and reference runs)."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        qh = q.transpose(0, 1)
        kh = k.repeat_interleave(groups, dim=1).transpose(0, 1)
        vh = v.repeat_interleave(groups, dim=1).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        return out.transpose(0, 1)
