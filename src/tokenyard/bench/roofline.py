"""The memory-bandwidth roofline of one-stream decode, for `tokenyard bench peers`.

Decoding one token of one stream reads every weight matrix once (the tied embedding too:
it is the LM head) and the KV cache of the context so far, and does ~2 FLOP per weight, far
less than a CPU does in the time those bytes take to arrive: the bytes bound the speed. The
ceiling is the machine's streaming-read bandwidth over the bytes read per token; an engine's
one-stream decode is reported as a share of it.

The bandwidth is measured, not looked up: the best of several timed sums over a buffer many
times larger than any L3 cache, with as many threads as the servers get.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

#: A buffer this large (GiB) defeats every cache; float32 sums over it stream from memory.
BUFFER_GIB = 2.0
#: Passes over the buffer, each timed in `SLICES` parts of BUFFER_GIB / SLICES (256 MiB,
#: still 8x a 32 MiB L3): on a shared machine a short part more often runs undisturbed.
REPEATS = 5
SLICES = 8


def measure_bandwidth(threads: int, gib: float = BUFFER_GIB, repeats: int = REPEATS,
                      slices: int = SLICES) -> float:
    """Bytes per second of the fastest of `repeats` x `slices` timed sums, each over the
    next 1 / `slices` of a `gib` GiB float32 buffer (written first, so its pages exist), on
    `threads` threads. Each part was evicted from the caches by the others since it was
    last read."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        parts = buffer.chunk(slices)
        best = 0.0
        for _ in range(repeats):
            for part in parts:
                started = time.perf_counter()
                part.sum()
                best = max(best, part.numel() * 4 / (time.perf_counter() - started))
        return best
    finally:
        torch.set_num_threads(previous)


def weight_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors that one decoded token reads: all of them, except an
    untied `token_embd.weight` (a lookup reads one row of it; tied, it is the LM head)."""
    from tokenyard.text.gguf_file import GGUFFile

    tensors = {t.name: t.data.nbytes for t in GGUFFile(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def kv_bytes(layers: int, kv_heads: int, head_dim: int, context: int,
             element_bytes: int = 2) -> int:
    """Bytes of keys and values that one token's attention reads over `context` tokens."""
    return 2 * layers * kv_heads * head_dim * context * element_bytes


@dataclass(frozen=True)
class Roofline:
    """Bandwidth (bytes/s) over the bytes read per decoded token."""

    bandwidth: float
    weights: int
    kv: int
    context: int

    @property
    def bytes_per_token(self) -> int:
        return self.weights + self.kv

    @property
    def ceiling_tok_s(self) -> float:
        """The most tokens per second one stream can decode at this bandwidth."""
        return self.bandwidth / self.bytes_per_token

    def share(self, tok_s: float) -> float:
        """`tok_s` as a fraction of the ceiling."""
        return tok_s / self.ceiling_tok_s


def model_roofline(path: Path, bandwidth: float, context: int) -> Roofline:
    """The roofline of the GGUF at `path` with a float16 KV cache of `context` tokens."""
    from tokenyard.engine.models.gguf_loader import open_gguf, read_gguf_config

    config = read_gguf_config(open_gguf(path))
    return Roofline(bandwidth, weight_bytes(path),
                    kv_bytes(config.num_hidden_layers, config.num_key_value_heads,
                             config.head_dim, context), context)


def roofline_table(roof: Roofline, decode: dict[str, list[float]]) -> str:
    """Markdown: the measured bandwidth, the bytes a token reads, the ceiling, and each
    server's median one-stream decode as a share of it (`decode`: server -> tok/s values)."""
    import statistics

    lines = [
        f"Memory-bandwidth roofline of one-stream decode: streaming read "
        f"{roof.bandwidth / 1e9:.1f} GB/s (the best of {REPEATS * SLICES} timed sums over "
        f"{BUFFER_GIB * 1024 / SLICES:g} MiB parts of a {BUFFER_GIB:g} GiB buffer, on the "
        f"servers' threads); a token reads {roof.weights / 1e6:,.0f} MB of weights (the "
        f"GGUF's tensors) + {roof.kv / 1e6:,.1f} MB of float16 KV at ~{roof.context} "
        f"tokens of context = {roof.bytes_per_token / 1e6:,.0f} MB, so the ceiling is "
        f"**{roof.ceiling_tok_s:.1f} tok/s**.", "",
        "| server | one-stream decode, median tok/s | share of the ceiling |", "|---|---|---|",
    ]
    for server, values in decode.items():
        if values:
            tok_s = statistics.median(values)
            lines.append(f"| {server} | {tok_s:.1f} | {roof.share(tok_s):.0%} |")
        else:
            lines.append(f"| {server} | - | - |")
    return "\n".join(lines)
