"""The contract between a model's attention layers and the engine's KV cache."""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Computes attention for one layer of one flat batch.

    Shapes: q is [T, num_heads, head_dim]; k and v are [T, num_kv_heads, head_dim], where
    T is the number of tokens in the step (all sequences concatenated). The backend writes
    k and v into its cache (if any) and returns [T, num_heads, head_dim]. RoPE has already
    been applied to q and k. With `window` set (Gemma's sliding layers), a query at
    position p attends only to keys at positions > p - window.
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor: ...


class CausalAttention:
    """Cache-free causal attention over a single sequence (tests and reference runs)."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        qh = q.transpose(0, 1)
        kh = k.repeat_interleave(groups, dim=1).transpose(0, 1)
        vh = v.repeat_interleave(groups, dim=1).transpose(0, 1)
        n = q.shape[0]
        if window is None or window >= n:
            out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=window_causal_mask(n, n, window, q.device)
            )
        return out.transpose(0, 1)


def window_causal_mask(
    num_queries: int, context_len: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean [q, ctx] mask for the last `num_queries` of `context_len` positions: query
    at position p sees keys at positions <= p, and > p - window when `window` is set."""
    q_pos = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible
