"""Decode steps replayed from CUDA graphs (`--cuda-graphs on`), as vLLM captures them: one
graph per batch size in `CAPTURE_SIZES`, a step of n decode rows replays the smallest
graph of at least n rows. A captured forward launches its ~500 kernels from the GPU in one
call, where the eager model spent most of a step's host time launching them (the H200
profile of issue 37: 16.6 ms of CPU against 2.3–4.7 ms of GPU a step).

The graphs read their inputs from static buffers: a step copies its token ids, positions,
KV slots, block tables and context lengths into the first n rows, and the padding rows
take position 0, context length 1 and a scratch KV slot that no request owns (one block
past the pool the KV manager hands out), so they write no request's keys and values. The
attention is the paged decode kernel (context lengths, no mask), the only one whose
launches do not depend on the step's values.

Used only for pure decode steps without adapter rows, on models without sliding-window
layers; anything else runs eagerly. Captured at start and checked against the eager
forward on random inputs; a failure keeps the engine eager and is logged.
`DecodeGraphs(capture=False)` runs the same buffers eagerly: the CPU tests use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tokenyard.engine.paged_attention import AttentionMetadata, PagedAttention

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)

Forward = Callable[[torch.Tensor, torch.Tensor, PagedAttention], torch.Tensor]


class DecodeGraphs:
    """Static buffers for up to `max_rows` decode rows of `max_blocks` blocks each, and a
    graph per size (see the module)."""

    def __init__(self, forward: Forward, attention: PagedAttention, max_rows: int,
                 max_blocks: int, scratch_slot: int, *, capture: bool = True) -> None:
        device = attention.k_cache.device
        self.forward, self.attention, self.capture = forward, attention, capture
        self.sizes = [s for s in CAPTURE_SIZES if s < max_rows] + [max_rows]
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_slot
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slots = torch.full((max_rows,), scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.long, device=device)
        self.lens = torch.ones(max_rows, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, meta: AttentionMetadata, num_rows: int) -> bool:
        """Whether a step of `num_rows` rows with `meta` can replay a graph: all decode
        rows, context lengths (not masks), within the buffers."""
        return (meta.num_decodes == num_rows and not meta.prefills and num_rows > 0
                and num_rows <= self.sizes[-1] and meta.decode_context_lens is not None
                and meta.decode_block_tables is not None
                and meta.decode_block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [n, hidden] of a step that `fits`."""
        n = meta.num_decodes
        size = next(s for s in self.sizes if s >= n)
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n, :width].copy_(meta.decode_block_tables)
        self.lens[:n].copy_(meta.decode_context_lens)
        if size > n:  # rows a larger step filled: back to the scratch slot
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(self.scratch_slot)
            self.lens[n:size].fill_(1)
        if not self.capture:
            return self._forward(size)[:n]
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]

    def capture_all(self) -> None:
        """Capture every size, largest first, into one memory pool."""
        pool = None
        for size in sorted(self.sizes, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up: kernels compiled, workspaces made
                self._forward(size)
                self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def _forward(self, size: int) -> torch.Tensor:
        self.attention.metadata = AttentionMetadata(
            slot_mapping=self.slots[:size], num_decodes=size,
            decode_block_tables=self.tables[:size], decode_mask=None, prefills=[],
            decode_context_lens=self.lens[:size])
        try:
            return self.forward(self.input_ids[:size], self.positions[:size],
                                self.attention)
        finally:
            self.attention.metadata = None


def build_decode_graphs(forward: Forward, attention: PagedAttention, max_rows: int,
                        max_blocks: int, scratch_slot: int, vocab: int) -> DecodeGraphs | None:
    """Captured graphs that agree with the eager forward on a random step; None (logged)
    when capture fails or they disagree."""
    try:
        graphs = DecodeGraphs(forward, attention, max_rows, max_blocks, scratch_slot)
        with torch.inference_mode():
            graphs.capture_all()
            _check(graphs, forward, attention, vocab)
    except Exception as exc:
        log.warning("CUDA graphs are off: %s", exc)
        return None
    log.info("captured CUDA graphs for decode steps of %s rows", graphs.sizes)
    return graphs


def _check(graphs: DecodeGraphs, forward: Forward, attention: PagedAttention,
           vocab: int) -> None:
    """A step of up to 3 rows, replayed and eager, within the scratch block (which no
    request owns: the writes of both land there)."""
    device = attention.k_cache.device
    block_size = attention.block_size
    scratch_block = graphs.scratch_slot // block_size
    n = min(3, graphs.sizes[-1], block_size)
    lens = torch.tensor([1, block_size // 2 + 1, block_size][:n], device=device)
    # Each row writes its own slot of the scratch block: no two writes race.
    slots = graphs.scratch_slot + torch.arange(n, device=device)
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=n,
        decode_block_tables=torch.full((n, 1), scratch_block, device=device),
        decode_mask=None, prefills=[], decode_context_lens=lens)
    ids = torch.randint(0, vocab, (n,), device=device)
    positions = lens - 1
    replayed = graphs.run(ids, positions, meta).clone()
    attention.metadata = meta
    try:
        eager = forward(ids, positions, attention)
    finally:
        attention.metadata = None
    error = float((replayed.float() - eager.float()).abs().max())
    scale = float(eager.float().abs().max()) or 1.0
    if not error <= 1e-2 * scale:
        raise AssertionError(f"a replayed step differs from the eager one by {error:.3g}")
