"""Rotary position embeddings (RoPE) in the Hugging Face "rotate half" layout.

Each head of size D is split into two halves (x1 = x[:D/2], x2 = x[D/2:]) and pair j is
rotated by the angle `position * inv_freq[j]`. Tables are built once per model and indexed
by position, so a forward step does no trigonometry.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: rope_type values `rope_inv_freq` understands; "default" is plain RoPE.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies of RoPE, float32 of shape [head_dim // 2] (radians per position).

    `scaling` follows Hugging Face `rope_scaling` / `rope_parameters` (keys `rope_type`,
    `factor`, ...). Supported types: "default", "linear" (positions divided by `factor`),
    "llama3" (Llama 3.1 frequency-dependent scaling) and "freq_factors" (llama.cpp's
    `rope_freqs` tensor: per-frequency divisors in `factors`). Anything else raises
    ValueError rather than silently producing wrong outputs. "longrope" (Phi-3) has two
    sets of frequencies, chosen per position: `rope_tables` builds it.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    # Same expression as transformers so the float32 tables match bit for bit.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = "default" if scaling is None else _rope_type(scaling)

    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":
        return _divided(inv_freq, scaling["factors"], "freq_factors")
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
    )


def _divided(inv_freq: torch.Tensor, factors_list: Any, what: str) -> torch.Tensor:
    factors = torch.tensor(factors_list, dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"rope {what} has {factors.numel()} entries, expected {inv_freq.numel()}")
    return inv_freq / factors


def _rope_type(scaling: dict[str, Any]) -> str:
    # Older configs spell the key "type"; transformers >= 4.45 uses "rope_type".
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept, and
    the band in between is interpolated smoothly."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


def rope_tables(
    head_dim: int,
    theta: float,
    max_positions: int,
    scaling: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables, each float32 of shape [max_positions, head_dim // 2].

    Row p holds cos/sin of `p * inv_freq`; only half a head is stored because both halves
    of a head share the same angles.
    """
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    if scaling is not None and _rope_type(scaling) == "longrope":
        return _longrope_tables(head_dim, theta, positions, scaling)
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def _longrope_tables(
    head_dim: int, theta: float, positions: torch.Tensor, scaling: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3's LongRoPE: frequencies divided by `short_factor` at positions below
    `original_max_position_embeddings` and by `long_factor` from there on, cos and sin
    scaled by `attention_factor` (default sqrt(1 + ln(factor) / ln(original))).

    Chosen per position, so a sequence's keys keep the rotation they were cached with:
    what transformers computes when a prompt shorter than the original context is then
    decoded past it (its prefill of a longer prompt uses the long factors throughout).
    """
    base = rope_inv_freq(head_dim, theta)
    original = int(scaling["original_max_position_embeddings"])
    short = _divided(base, scaling["short_factor"], "short_factor")
    long = _divided(base, scaling["long_factor"], "long_factor")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = float(scaling.get("factor", 1.0))
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
    inv_freq = torch.where((positions >= original)[:, None], long[None, :], short[None, :])
    angles = positions[:, None] * inv_freq
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [T, H, D] by per-token angles; `cos`/`sin` are [T, 1, D // 2].

    Returns a new contiguous [T, H, D] tensor; `x` may be a strided view (e.g. the q/k part
    of a fused qkv projection) and is not modified.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1 = out[..., :half]
    out2 = out[..., half:]
    # Written straight into the two halves of `out`: four kernels and no temporaries,
    # instead of rotate_half's negate + cat + two full-width products.
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin)
    return out
