"""`tokenyard bench micro`: the kernel-level measurements behind the engine's CPU choices.

- small-M matmuls: `F.linear` against `split_linear` (one bmm over per-core row slices);
- block-quantized weights (kernels/blocks.py): the integer kernel at Q8_0 / Q4_1 with int16
  and int8 activations against float32, and the kernel against dequantize + GEMM at
  prefill sizes (where `KERNEL_MAX_ROWS` comes from);
- SDPA on a 1,000-token causal prefill with 3-D inputs (math kernel) against 4-D (flash);
- the prefix-cache hit: a ~1,000-token prompt again, its cached prefix read in place by the
  paged kernel against gathered for SDPA (`prefix_hit.py`);
- quality of the block formats on the embedded model: teacher-forced next-token top-1
  agreement with float32, mean KL and perplexity over the public-domain text the package
  ships (`data/public_domain.txt`), every position through the decode kernel.
Weights rotate through several copies so they come from memory, as in a real forward pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenyard.bench import prefix_hit
from tokenyard.engine.attention_backend import CausalAttention
from tokenyard.engine.kernels import blocks, unavailable_reason
from tokenyard.engine.models.llama import split_linear
from tokenyard.engine.models.loader import CausalLM, LoadedModel, build_model, load_model
from tokenyard.engine.models.quant import convert_weights
from tokenyard.text.tokenizer import Tokenizer

TEXT_FILE = Path(__file__).resolve().parent / "data" / "public_domain.txt"

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


BLOCK_SHAPES = [(3072, 576, 1), (960, 576, 1), (576, 1536, 1), (49152, 576, 1), (3072, 576, 8),
                (3072, 576, 64), (3072, 576, 128), (3072, 576, 256)]


def block_matmul_rows() -> list[tuple[str, dict[str, float]]]:
    """Microseconds per call: float32 split bmm against the block kernel (q8_0 / q4_1 with
    int16 activations, q4_1 with int8) and, from 64 rows up, dequantize + GEMM; measured in
    alternating rounds, medians."""
    return [(f"{out_f} x {in_f}, M = {m}", _block_matmul_times(out_f, in_f, m))
            for out_f, in_f, m in BLOCK_SHAPES]


def _block_matmul_times(out_f: int, in_f: int, m: int) -> dict[str, float]:
    ops = torch.ops.tokenyard_quant
    parts = torch.get_num_threads()
    copies = 1 if out_f > 10_000 else 6
    weights = [torch.randn(out_f, in_f) for _ in range(copies)]
    q8 = [blocks.BlockWeight.quantize(w, blocks.Q8_0) for w in weights]
    q4 = [blocks.BlockWeight.quantize(w, blocks.Q4_1) for w in weights]
    x = torch.randn(m, in_f)
    fns: dict[str, Callable[[int], object]] = {
        "float32": lambda i: split_linear(x, weights[i], parts),
        "q8_0": lambda i: ops.quant_matmul(x, q8[i].data, blocks.Q8_0, 16),
        "q4_1": lambda i: ops.quant_matmul(x, q4[i].data, blocks.Q4_1, 16),
        "q4_1 int8 act": lambda i: ops.quant_matmul(x, q4[i].data, blocks.Q4_1, 8),
    }
    if m >= 64:
        fns["q4_1 dequant+GEMM"] = lambda i: q4[i].gemm(x)
    reps = 3 if out_f > 10_000 or m > 64 else 20
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(5):
        for name, fn in fns.items():
            start = time.perf_counter()
            for r in range(reps):
                fn(r % copies)
            times[name].append((time.perf_counter() - start) / reps * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


@dataclass(frozen=True)
class Quality:
    """A weight format against float32 on the same text, teacher-forced."""

    weights: str
    positions: int
    top1: float  # share of positions whose most likely next token is float32's
    kl: float  # mean KL(float32 || quantized) of the next-token distributions, nats
    ppl_float: float
    ppl_quant: float


def public_domain_tokens(tokenizer: Tokenizer, limit: int | None = None) -> torch.Tensor:
    """Token ids of the shipped public-domain text (about 2,360 with SmolLM2's tokenizer)."""
    ids = tokenizer.encode(TEXT_FILE.read_text(encoding="utf-8"))
    return torch.tensor(ids[:limit], dtype=torch.long)


def teacher_forced_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [T, vocab] at every position of one sequence."""
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), CausalAttention())
        return model.compute_logits(hidden).float()


def compare_logits(
    reference: torch.Tensor, quant: torch.Tensor, ids: torch.Tensor, weights: str
) -> Quality:
    ref_lp = F.log_softmax(reference, dim=-1)
    q_lp = F.log_softmax(quant, dim=-1)
    kl = (ref_lp.exp() * (ref_lp - q_lp)).sum(dim=-1)
    top1 = (reference.argmax(dim=-1) == quant.argmax(dim=-1)).float().mean().item()
    targets = ids[1:, None]

    def ppl(lp: torch.Tensor) -> float:
        return math.exp(-lp[:-1].gather(1, targets).mean().item())

    return Quality(weights, len(ids), top1, kl.mean().item(), ppl(ref_lp), ppl(q_lp))


def weights_quality(
    loaded: LoadedModel, reference: torch.Tensor, ids: torch.Tensor, weights: str
) -> Quality:
    """Build `loaded` in `weights` and compare its teacher-forced logits with `reference`
    (float32's), every position through the decode kernel."""
    model = convert_weights(build_model(loaded), loaded, weights)
    with blocks.kernel_for_all_rows():
        logits = teacher_forced_logits(model, ids)
    return compare_logits(reference, logits, ids, weights)


def quality_table(formats: tuple[str, ...] = ("q8_0", "q4_1")) -> list[Quality]:
    loaded = load_model(None, show_progress=False)
    ids = public_domain_tokens(loaded.tokenizer)
    reference = teacher_forced_logits(build_model(loaded), ids)
    results = [weights_quality(loaded, reference, ids, w) for w in formats]
    saved = blocks.ACT_BITS
    try:
        blocks.ACT_BITS = 8
        int8 = weights_quality(loaded, reference, ids, "q4_1")
        results.append(dataclasses.replace(int8, weights="q4_1, int8 activations"))
    finally:
        blocks.ACT_BITS = saved
    return results


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
    print(prefix_hit.render(prefix_hit.measure(threads=parts), parts))
    if not blocks.kernel_available():
        print(f"\nblock kernels unavailable: {unavailable_reason('quant_matmul')}")
        return 0
    print("\nBlock-quantized weights (quant_matmul kernel), microseconds per call, medians "
          "of 5 alternating rounds; activations int16 per block of 32 unless said")
    table = block_matmul_rows()
    names = list(table[-1][1])
    print("| weight (out x in), rows M | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for label, times in table:
        cells = [f"{times[n]:,.0f}" if n in times else "" for n in names]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nQuality against float32 on the embedded model, teacher-forced over "
          f"{TEXT_FILE.name} (every position through the decode kernel)")
    print("| weights | positions | top-1 agreement | mean KL | perplexity (float32) |")
    print("|---|---|---|---|---|")
    for q in quality_table():
        change = (q.ppl_quant / q.ppl_float - 1) * 100
        print(f"| {q.weights} | {q.positions} | {q.top1 * 100:.2f} % | {q.kl:.5f} | "
              f"{q.ppl_quant:.3f} ({q.ppl_float:.3f}, {change:+.2f} %) |")
    return 0
