"""`tokenyard bench micro`: the kernel-level measurements behind the engine's CPU choices.

- small-M matmuls: `F.linear` against `split_linear` (one bmm over per-core row slices);
- SDPA on a 1,000-token causal prefill with 3-D inputs (math kernel) against 4-D (flash).
Weights rotate through several copies so they come from memory, as in a real forward pass.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenyard.engine.models.llama import split_linear

SHAPES = [(3072, 576, 1), (960, 576, 1), (3072, 576, 8), (49152, 576, 8), (3072, 576, 64)]


def time_us(fn: Callable[[], object], repeats: int) -> float:
    """Median of 5 batches of `repeats` calls, microseconds per call."""
    for _ in range(3):
        fn()
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        batches.append((time.perf_counter() - start) / repeats * 1e6)
    return sorted(batches)[2]


def time_matmuls(weights: list[torch.Tensor], x: torch.Tensor, parts: int) -> tuple[float, float]:
    """(F.linear, split_linear) microseconds for x against weights taken in turn."""
    turn = [0]

    def nxt() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(weights)
        return weights[turn[0]]

    reps = 10 if weights[0].shape[0] > 10_000 else 100
    plain = time_us(lambda: F.linear(x, nxt()), reps)
    split = time_us(lambda: split_linear(x, nxt(), parts), reps)
    return plain, split


def matmul_rows(parts: int) -> list[tuple[str, float, float]]:
    rows = []
    for out_f, in_f, m in SHAPES:
        copies = 1 if out_f > 10_000 else 6
        weights = [torch.randn(out_f, in_f) for _ in range(copies)]
        plain, split = time_matmuls(weights, torch.randn(m, in_f), parts)
        rows.append((f"{out_f} x {in_f}, M = {m}", plain, split))
    return rows


def sdpa_ms(length: int = 1000, heads: int = 9, head_dim: int = 64) -> tuple[float, float]:
    q, k, v = (torch.randn(1, heads, length, head_dim) for _ in range(3))
    three_d = time_us(lambda: F.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True), 3)
    four_d = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 3)
    return three_d / 1000, four_d / 1000


def main(args: argparse.Namespace) -> int:
    parts = torch.get_num_threads()
    print(f"torch {torch.__version__}, {parts} threads; medians of 5 batches")
    print("| weight (out x in), rows M | F.linear | split bmm | ratio |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for name, plain, split in matmul_rows(parts):
            print(f"| {name} | {plain:,.0f} us | {split:,.0f} us | {plain / split:.1f}x |")
        three_d, four_d = sdpa_ms()
    print(f"\nSDPA, 1,000-token causal prefill, 9 heads: 3-D inputs {three_d:.0f} ms, "
          f"4-D inputs {four_d:.0f} ms ({three_d / four_d:.1f}x)")
    return 0
