"""Paged decode attention for CUDA in Triton: each decode row's query heads attend over
its context read from the paged KV pool in place, through its block table (no gather
into a contiguous tensor, no mask).

The same contract as the C++ CPU op (`kernels.load_paged_decode`): ``out[N, H, D] =
softmax(scale * q k^T) v`` over each row's first ``context_lens[i]`` cached tokens, and
with ``tail`` = t > 1 each row holds t consecutive query positions, heads ordered [kv
head][position][query group], the last at ``context_lens[i]`` (causal within them).

One program per (row, kv head) computes that kv head's whole query group, so each K/V
token is read once for the group (grouped-query attention), ``BLOCK_N`` tokens at a time
with an online softmax. Everything is float32: the two products in full precision over
a float32 pool, in TF32 over a float16 or bfloat16 one (more mantissa than the pool's own).
Triton's interpreter multiplies bfloat16 tiles wrongly (their bits as integers), so the
kernel never multiplies in the pool's type: the CPU tests run the code the GPU runs.

Nothing here runs at import: `load_triton_paged_decode` imports Triton, and on a CUDA
device checks the kernel against the gather + SDPA reference before the engine uses it
(a compile failure or a wrong answer leaves the torch path in place, logged). Tests run
it on the CPU with Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenyard.engine.kernels.build import kernels_disabled

log = logging.getLogger(__name__)

#: Context tokens per loop iteration of a program.
BLOCK_N = 64
#: Query heads of one program, padded to a tensor-core tile.
MIN_GROUP_ROWS = 16

_kernel: Any = None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
        stride_qn, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_tn, stride_on, stride_oh,
        G: tl.constexpr, PER_POSITION: tl.constexpr, TAIL: tl.constexpr,
        BS: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx = tl.load(lens_ptr + row)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        g_ok = g < G
        d_ok = d < D
        heads = kv_head * G + g
        q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        # The keys each head sees: its query position's (causal within a tail).
        seen = ctx - TAIL + g // PER_POSITION + 1
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for start in range(0, ctx, BLOCK):
            toks = start + tl.arange(0, BLOCK)
            t_ok = toks < ctx
            block = tl.load(tables_ptr + row * stride_tn + toks // BS, mask=t_ok, other=0)
            slot = toks % BS
            kv_ok = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + block[:, None].to(tl.int64) * stride_kb
                        + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                        mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + block[:, None].to(tl.int64) * stride_vb
                        + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                        mask=kv_ok, other=0.0)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
            s = tl.where(toks[None, :] < seen[:, None], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_on + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    return paged_decode_kernel


def _pow2(n: int, least: int) -> int:
    size = least
    while size < n:
        size *= 2
    return size


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 tail: int = 1) -> torch.Tensor:
    """Attention of `q` [N, H, D] over one layer's pool (`k_cache`, `v_cache`: [blocks,
    block size, kv heads, D]) through `block_tables` [N, max blocks] and `context_lens`
    [N] (see the module)."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if heads % kv_heads or group % tail:
        raise ValueError("paged_decode: the query heads do not split into the kv heads' "
                         "groups and the tail's positions")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_decode: the head dimension must be contiguous")
    out = torch.empty_like(q)
    if n == 0:
        return out
    lens = context_lens.to(device=q.device, dtype=torch.int64)
    tables = block_tables.to(device=q.device, dtype=torch.int64)
    _kernel[(n, kv_heads)](
        q, k_cache, v_cache, tables, lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1),
        G=group, PER_POSITION=group // tail, TAIL=tail, BS=block_size, D=dim,
        G_PAD=_pow2(group, MIN_GROUP_ROWS), D_PAD=_pow2(dim, 16), BLOCK=BLOCK_N,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
    return out


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
              tail: int = 1) -> torch.Tensor:
    """The same attention by gathering each row's context and masking (float32)."""
    n, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    per = group // tail
    out = torch.empty(n, heads, dim, dtype=torch.float32, device=q.device)
    for i in range(n):
        ctx = int(context_lens[i])
        blocks = block_tables[i, : -(-ctx // block_size)]
        keys = k_cache[blocks].reshape(-1, kv_heads, dim)[:ctx].float()
        values = v_cache[blocks].reshape(-1, kv_heads, dim)[:ctx].float()
        for h in range(heads):
            kv, seen = h // group, ctx - tail + (h % group) // per + 1
            scores = (keys[:seen, kv] @ q[i, h].float()) * scale
            out[i, h] = torch.softmax(scores, 0) @ values[:seen, kv]
    return out


def load_triton_paged_decode(device: torch.device) -> Any:
    """`paged_decode` if Triton imports and, on `device`, agrees with `reference` on a
    small case of each pool type the engine may use; None otherwise (logged once)."""
    if kernels_disabled():
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        log.info("Triton is not installed: decode attention gathers the paged KV pool")
        return None
    try:
        _self_check(device)
    except Exception as exc:  # a compile failure or a wrong answer: the torch path stays
        log.warning("the Triton paged decode kernel failed its check on %s (%s); decode "
                    "attention gathers the paged KV pool", device, exc)
        return None
    return paged_decode


def _self_check(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        blocks, size, kv_heads, dim = 8, 16, 2, 64
        k = torch.randn(blocks, size, kv_heads, dim, generator=gen).to(device, dtype)
        v = torch.randn(blocks, size, kv_heads, dim, generator=gen).to(device, dtype)
        q = torch.randn(3, 6, dim, generator=gen).to(device, dtype)
        tables = torch.tensor([[3, 1, 0, 0], [2, 5, 7, 4], [6, 0, 0, 0]], device=device)
        lens = torch.tensor([20, 64, 1], device=device)
        got = paged_decode(q, k, v, tables, lens, dim**-0.5).float()
        want = reference(q, k, v, tables, lens, dim**-0.5)
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        error = float((got - want).abs().max())
        if not error <= tolerance:
            raise AssertionError(f"{dtype}: largest difference {error:.2e}")
