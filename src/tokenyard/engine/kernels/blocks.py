"""Weights kept in ggml block formats, and the matmul that computes on them in place.

A `BlockWeight` holds a [out, in] matrix as uint8 rows of blocks of 32 input values,
byte for byte as a GGUF file stores them:

- Q8_0, 34 bytes a block: fp16 scale d, 32 int8 q; w = d * q (8.5 bits a weight);
- Q4_1, 20 bytes a block: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m, element j
  in the low nibble of byte j and element j + 16 in its high nibble (5 bits a weight).
  Q4_0 blocks (fp16 d, nibbles, w = d * (q - 8)) become Q4_1 losslessly (m = -8 d).

`matmul` quantizes each activation row per block of 32 with its own scale, to int16 by
default (`ACT_BITS`; int8 as llama.cpp does costs SmolLM2 ~4 % of greedy top-1 agreement
with float32, because its outlier channels crush the rest of their block; int16 ~0.1 %),
and runs the C++ kernel (`quant_matmul.cpp`) for up to `KERNEL_MAX_ROWS` rows; more rows (a
prefill) are dequantized to float32 in tiles of weight rows and go through torch's GEMM,
which measured faster there (`tokenyard bench micro`). Without the kernel every path
falls back to torch (dequantize + F.linear: correct but slow; the engine avoids it by
keeping float32 weights when the kernel is missing, see models/quant.py).

The torch functions here (`quantize_*`, `dequantize_torch`, `reference_matmul`) are the
specification the kernel is tested against.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenyard.engine.kernels.build import load_ops

log = logging.getLogger(__name__)

BLOCK = 32
Q8_0 = 0
Q4_1 = 1
QTYPE_NAMES = {Q8_0: "Q8_0", Q4_1: "Q4_1"}
BLOCK_BYTES = {Q8_0: 34, Q4_1: 20}

#: Integer width of the quantized activations (8 or 16), per block of 32.
ACT_BITS = 16
#: Up to this many rows the integer kernel runs; above it, dequantized tiles + GEMM.
KERNEL_MAX_ROWS = 64
#: Weight rows dequantized at once on the GEMM path (bounds the float32 scratch it reuses:
#: 4,096 x 576 floats = 9.4 MB).
GEMM_TILE_ROWS = 4096

_KERNEL = "quant_matmul"


@contextmanager
def kernel_for_all_rows() -> Iterator[None]:
    """Run every block matmul through the integer kernel, whatever its row count: a
    teacher-forced pass over a long text then sees each position exactly as one decode
    step would (quality measurements)."""
    global KERNEL_MAX_ROWS
    saved, KERNEL_MAX_ROWS = KERNEL_MAX_ROWS, 1 << 62
    try:
        yield
    finally:
        KERNEL_MAX_ROWS = saved


def kernel_available(cache_dir: Path | None = None) -> bool:
    """Build/load the block kernels once; False (reason logged) when they are unavailable."""
    if cache_dir is None:
        from tokenyard.config import default_cache_dir

        cache_dir = default_cache_dir()
    return load_ops(_KERNEL, cache_dir)


_ops_cache: list[object | None] = []


def _ops() -> object | None:
    """`torch.ops.tokenyard_quant` once the kernel is loaded, else None (looked up once)."""
    if not _ops_cache:
        _ops_cache.append(torch.ops.tokenyard_quant if kernel_available() else None)
    return _ops_cache[0]


# --- block formats in torch (the reference) ----------------------------------------------


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> Q8_0 blocks uint8 [N, K / 32 * 34] (d = max|w| / 127 per block)."""
    n, k = _check_shape(weight)
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(dim=-1) / 127.0).to(torch.float16)
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    packed = torch.cat([d.unsqueeze(-1).view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return packed.reshape(n, -1).contiguous()


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> Q4_1 blocks uint8 [N, K / 32 * 20] (d = (max - min) / 15, m = min)."""
    n, k = _check_shape(weight)
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    lo = blocks.amin(dim=-1)
    d = ((blocks.amax(dim=-1) - lo) / 15.0).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round((blocks - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15)
    q = q.to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    packed = torch.cat(
        [d.unsqueeze(-1).view(torch.uint8), m.unsqueeze(-1).view(torch.uint8), nibbles], dim=-1
    )
    return packed.reshape(n, -1).contiguous()


def q4_0_to_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 blocks uint8 [N, nb * 18] -> Q4_1 [N, nb * 20] with the same values."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 18)
    d = blocks[..., :2].contiguous().view(torch.float16)
    m = (d.float() * -8.0).to(torch.float16)  # exact: a power-of-two multiple
    packed = torch.cat([blocks[..., :2], m.view(torch.uint8), blocks[..., 2:]], dim=-1)
    return packed.reshape(n, -1).contiguous()


def dequantize_torch(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """Blocks uint8 [N, nb * bytes] -> float32 [N, nb * 32] (torch ops only)."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, BLOCK_BYTES[qtype])
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    if qtype == Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    return (q * d + m).reshape(n, -1)


def quantize_activations_torch(x: torch.Tensor, bits: int = ACT_BITS) -> torch.Tensor:
    """x [M, K] rounded the way the kernel sees it: integers of `bits` per block of 32,
    d = max|x| / (2^(bits-1) - 1)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / float(2 ** (bits - 1) - 1)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros((), dtype=torch.float32))
    return (torch.round(blocks * inv) * d).reshape(m, k)


def reference_matmul(
    x: torch.Tensor, data: torch.Tensor, qtype: int, bits: int = ACT_BITS
) -> torch.Tensor:
    """What `quant_matmul` computes, in float64 torch ops: quantized x @ dequantized W^T."""
    xq = quantize_activations_torch(x, bits).double()
    return (xq @ dequantize_torch(data, qtype).double().t()).float()


def _check_shape(weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"block formats need a 2-D weight with K % 32 == 0, got {weight.shape}")
    return int(weight.shape[0]), int(weight.shape[1])


# --- the module-side holder ---------------------------------------------------------------


class BlockWeight:
    """A [out_features, in_features] weight kept in Q8_0 or Q4_1 blocks (no float copy)."""

    def __init__(self, data: torch.Tensor, qtype: int, in_features: int) -> None:
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"unknown block type {qtype}")
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise ValueError("block data must be a 2-D uint8 tensor")
        if in_features % BLOCK or data.shape[1] != in_features // BLOCK * BLOCK_BYTES[qtype]:
            raise ValueError(
                f"{QTYPE_NAMES[qtype]} rows of {data.shape[1]} bytes do not hold "
                f"{in_features} values"
            )
        self.data = data.contiguous()
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = int(data.shape[0])

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: int) -> BlockWeight:
        data = quantize_q8_0(weight) if qtype == Q8_0 else quantize_q4_1(weight)
        return cls(data, qtype, int(weight.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __repr__(self) -> str:
        return (f"BlockWeight({QTYPE_NAMES[self.qtype]}, {self.out_features} x "
                f"{self.in_features}, {self.nbytes / 1e6:.1f} MB)")

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) as float32."""
        rows = self.data[start:stop]
        ops = _ops()
        if ops is None:
            return dequantize_torch(rows, self.qtype)
        out: torch.Tensor = ops.dequantize(rows, self.qtype, self.in_features)  # type: ignore[attr-defined]
        return out

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] as float32 [T, in_features] (only those rows are dequantized)."""
        ops = _ops()
        if ops is None:
            return dequantize_torch(self.data[ids], self.qtype)
        out: torch.Tensor = ops.embedding(self.data, self.qtype, self.in_features, ids)  # type: ignore[attr-defined]
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] float32 -> x @ W^T [M, out] float32."""
        ops = _ops()
        if ops is not None and x.shape[0] <= KERNEL_MAX_ROWS:
            out: torch.Tensor = ops.quant_matmul(x, self.data, self.qtype, ACT_BITS)  # type: ignore[attr-defined]
            return out
        return self.gemm(x)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through float32 tiles of W and torch's GEMM (x is not quantized)."""
        ops = _ops()
        if ops is None:
            return F.linear(x, self.dequantize())
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        for start in range(0, self.out_features, GEMM_TILE_ROWS):
            stop = min(start + GEMM_TILE_ROWS, self.out_features)
            tile = _scratch((stop - start) * self.in_features).view(stop - start, -1)
            ops.dequantize_out(self.data[start:stop], self.qtype, self.in_features, tile)  # type: ignore[attr-defined]
            if start == 0 and stop == self.out_features:
                return F.linear(x, tile)
            out[:, start:stop] = F.linear(x, tile)
        return out


_scratch_buf: list[torch.Tensor] = []


def _scratch(numel: int) -> torch.Tensor:
    """A float32 buffer of `numel` values reused across calls (the engine runs the model
    on one thread at a time; the GEMM path consumes a tile before the next is written)."""
    if not _scratch_buf or _scratch_buf[0].numel() < numel:
        _scratch_buf[:] = [torch.empty(numel, dtype=torch.float32)]
    return _scratch_buf[0][:numel]
