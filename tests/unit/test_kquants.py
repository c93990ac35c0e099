"""The GGUF block types of Gemma 3 270M's file that the loader dequantizes with the `gguf`
package (Q4_K, Q6_K, Q5_0), against torch references written here from ggml's block
layouts: on random blocks, and on the real file's tensors when it is installed."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenyard.text.gguf_file import GGUFFile
from tokenyard.text.model_files import PACKAGED_MODELS, packaged_model_path

Q4_K, Q6_K, Q5_0 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q5_0
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210, Q5_0: 22}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from [N, 2] uint8 -> float32 [N, 1]."""
    return raw.contiguous().view(torch.float16).float()


def ref_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 144] uint8 -> [N, 256]: d, dmin (fp16), 12 bytes of 6-bit scales and mins for
    8 sub-blocks of 32, then 128 bytes of 4-bit quants (64 values per 32 bytes: low
    nibbles first, then high). value = d * scale * q - dmin * min."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    s = blocks[:, 4:16].long()
    qs = blocks[:, 16:144].long()
    scales, mins = [], []
    for j in range(8):
        if j < 4:
            scales.append(s[:, j] & 63)
            mins.append(s[:, j + 4] & 63)
        else:
            scales.append((s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4))
            mins.append((s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4))
    out = []
    for j in range(4):
        q = qs[:, 32 * j: 32 * j + 32]
        for half, nibble in enumerate((q & 0xF, q >> 4)):
            k = 2 * j + half
            out.append(d * scales[k][:, None] * nibble - dmin * mins[k][:, None])
    return torch.cat(out, dim=1).float()


def ref_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 210] uint8 -> [N, 256]: 128 bytes of low 4 bits, 64 bytes of high 2 bits,
    16 int8 scales (one per 16 values), d (fp16). value = d * scale * (q - 32)."""
    ql, qh = blocks[:, 0:128].long(), blocks[:, 128:192].long()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).long()
    d = _f16(blocks[:, 208:210])
    out = torch.empty(blocks.shape[0], 256)
    for h in range(2):
        lo, hi, sc = ql[:, 64 * h: 64 * h + 64], qh[:, 32 * h: 32 * h + 32], scales[:, 8 * h:]
        quarters = (
            (lo[:, :32] & 0xF) | ((hi & 3) << 4),
            (lo[:, 32:] & 0xF) | (((hi >> 2) & 3) << 4),
            (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4),
            (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4),
        )
        for n, q in enumerate(quarters):
            # Values l of this quarter use scale number l // 16, two per quarter.
            scale = sc[:, 2 * n: 2 * n + 2].repeat_interleave(16, dim=1)
            out[:, 128 * h + 32 * n: 128 * h + 32 * n + 32] = (d * scale * (q - 32)).float()
    return out


def ref_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """[N, 22] uint8 -> [N, 32]: d (fp16), 32 fifth bits (uint32), 16 bytes of nibbles.
    value = d * (q - 16)."""
    d = _f16(blocks[:, 0:2])
    qh = blocks[:, 2:6].contiguous().view(torch.int32).long() & 0xFFFFFFFF
    qs = blocks[:, 6:22].long()
    j = torch.arange(16)
    low = (qs & 0xF) | (((qh >> j) & 1) << 4)
    high = (qs >> 4) | (((qh >> (j + 16)) & 1) << 4)
    return (d * (torch.cat([low, high], dim=1) - 16)).float()


REFERENCES = {Q4_K: ref_q4_k, Q6_K: ref_q6_k, Q5_0: ref_q5_0}
#: Byte offsets of each type's fp16 scales, set to finite values in random blocks.
_FP16_AT = {Q4_K: (0, 2), Q6_K: (208,), Q5_0: (0,)}


@pytest.mark.parametrize("qtype", list(REFERENCES), ids=lambda t: t.name)
def test_gguf_dequantize_matches_the_reference_on_random_blocks(
    qtype: GGMLQuantizationType,
) -> None:
    gen = torch.Generator().manual_seed(int(qtype))
    blocks = torch.randint(0, 256, (64, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=gen)
    for at in _FP16_AT[qtype]:
        scale = (torch.rand(64, 1, generator=gen) * 0.1).half()
        blocks[:, at: at + 2] = scale.view(torch.uint8)
    expected = REFERENCES[qtype](blocks)
    got = torch.from_numpy(np.asarray(dequantize(blocks.numpy(), qtype), dtype=np.float32))
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-6, atol=1e-6)


def test_gguf_dequantize_matches_the_reference_on_gemma_270m() -> None:
    model = PACKAGED_MODELS["gemma3-270m"]
    if any(importlib.util.find_spec(p) is None for p in model.chunk_packages):
        pytest.skip("Gemma 3 270M chunk packages not installed")
    reader = GGUFFile(packaged_model_path("gemma3-270m"))
    seen = set()
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        if qtype not in REFERENCES or qtype in seen:
            continue
        seen.add(qtype)
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        raw = raw.reshape(-1, BLOCK_BYTES[qtype])
        got = np.asarray(dequantize(tensor.data, qtype), dtype=np.float32).reshape(-1)
        torch.testing.assert_close(torch.from_numpy(got), REFERENCES[qtype](raw).reshape(-1),
                                   rtol=1e-6, atol=1e-6)
    assert seen == set(REFERENCES)
