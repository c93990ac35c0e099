"""Attention over the paged KV cache for one flat batch of mixed prefill and decode tokens."""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenyard.engine.attention_backend import window_causal_mask
from tokenyard.engine.kernels import PagedDecodeFn, load_paged_decode
from tokenyard.engine.kernels.triton_decode import load_triton_paged_decode

log = logging.getLogger(__name__)

#: A prefill span over a cached prefix with at most this many new rows (the tail of a
#: prompt whose prefix was cached) goes through the paged decode kernel, its rows folded
#: into the kv heads' query groups, each with its own causal length: reading the blocks
#: in place costs less than gathering the whole context into one tensor for SDPA, once
#: per layer (`tokenyard bench micro`'s prefix-hit case measures both paths side by
#: side). 16 is not tuned: longer tails were not measured.
KERNEL_TAIL_ROWS = 16
#: Where the model has the one-op decode step (models/decode_step.py), a step whose spans
#: are all tails over a cached prefix of at most this many rows runs through it instead,
#: each tail token a row with its own context length (`as_decode_rows`): the same kernels
#: without ~25 dispatched torch ops a layer. 0 turns it off (the eager path above).
ONE_OP_TAIL_ROWS = KERNEL_TAIL_ROWS


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zero tensor whose CPU pages become resident only when first written.

    `torch.zeros` writes every page, so a 1 GiB KV pool cost 1 GiB of RSS at start however
    little of it was used. An anonymous mapping reads as zeros (never garbage: the padded
    block-table entries and masked slots the torch path reads must stay finite) and the
    kernel backs a page only on its first write. On CUDA the pool is device memory: zeros.
    """
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor holds a reference to the mapping, which lives as long as the tensor.
    buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


@dataclass
class PrefillSpan:
    """One sequence computing several tokens this step."""

    start: int  # first row of the sequence in the flat batch
    num_tokens: int  # rows computed this step
    context_len: int  # tokens attended to, cached prefix plus this step's rows
    block_table: torch.Tensor | None  # [n_blocks] long; None when nothing was cached before
    #: (block tables [C, n_blocks], context lengths [C]) of the span's rows as C chunks of
    #: folded query positions for the paged kernel: made by the first layer that needs
    #: them, reused by the rest.
    kernel_rows: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to.

    Decode rows (one new token per sequence) come first in the flat batch and are batched
    together; each prefill span is attended separately (its query length differs).
    """

    slot_mapping: torch.Tensor  # [T] long: cache slot each token's k/v is written to
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long, padded with 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks*block_size] additive
    prefills: list[PrefillSpan]
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] long, on the CPU kernel path


class PagedAttention:
    """KV cache for every layer plus the attention computation over it.

    Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], so a block is
    one contiguous chunk and a sequence's context is gathered block by block.

    Decode rows on the CPU with a float32 cache go through the C++ paged decode kernel
    (reads the blocks in place: no gather, no mask), built on first construction and cached
    under `kernel_cache_dir`; on CUDA through the Triton one (`kernels/triton_decode.py`,
    checked against the reference on the device first); when neither is available the
    torch gather + SDPA path is used.

    A sliding-window layer (`window`, Gemma 3) keeps its whole context in the cache like
    any other and masks what lies outside the window; its decode rows take the torch path
    only in a step where some row's context is longer than the window.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernel_cache_dir: Path | None = None,
        use_kernel: bool = True,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: the model's (queries, outputs); `cache_dtype`: the pool's elements
        (None: `dtype`). A float16 pool under a float32 model halves the pool's bytes;
        keys and values are rounded once, when written, and read back as float32."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        cache_dtype = cache_dtype or dtype
        self.k_cache = lazy_zeros(shape, cache_dtype, device)
        self.v_cache = lazy_zeros(shape, cache_dtype, device)
        self.block_size = block_size
        self.metadata: AttentionMetadata | None = None
        self.decode_kernel: PagedDecodeFn | None = None
        # Decode masks of sliding-window layers, by window, for the metadata they were made
        # for: computed once a step, shared by every layer with that window.
        self._window_meta: AttentionMetadata | None = None
        self._window_masks: dict[int, torch.Tensor | None] = {}
        if use_kernel and self.k_cache.device.type == "cpu" and dtype == torch.float32 \
                and cache_dtype in (torch.float32, torch.float16):
            self.decode_kernel = load_paged_decode(kernel_cache_dir)
        elif use_kernel and self.k_cache.device.type == "cuda":
            self.decode_kernel = load_triton_paged_decode(self.k_cache.device)

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    def resident_bytes(self) -> int:
        """Bytes of the CPU pool backed by memory now (pages written at least once)."""
        return sum(resident_bytes(cache) for cache in (self.k_cache, self.v_cache))

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        meta = self.metadata
        assert meta is not None, "set metadata before the forward pass"
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))

        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        groups = num_heads // num_kv_heads
        out = torch.empty_like(q)
        nd = meta.num_decodes
        decode_mask = meta.decode_mask
        if nd and window is not None:
            window_mask = self._decode_window_mask(meta, window)
            decode_mask = decode_mask if window_mask is None else window_mask
        if decode_mask is meta.decode_mask and nd and self.decode_kernel is not None \
                and meta.decode_context_lens is not None:
            assert meta.decode_block_tables is not None
            out[:nd] = self.decode_kernel(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                head_dim**-0.5,
            )
        elif nd:
            assert meta.decode_block_tables is not None
            # Each kv head's query group plays the part of the query length.
            qd = q[:nd].view(nd, num_kv_heads, groups, head_dim)
            kd = _gather_blocks(k_cache, meta.decode_block_tables, q.dtype).transpose(1, 2)
            vd = _gather_blocks(v_cache, meta.decode_block_tables, q.dtype).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=decode_mask)
            out[:nd] = od.reshape(nd, num_heads, head_dim)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.num_tokens)
            # 4-D [1, heads, L, D]: with 3-D inputs SDPA falls back to its math kernel on
            # the CPU (3x slower: 2.4 of 5.2 s on a 1,000-token prompt).
            if (span.block_table is not None and window is None
                    and self.decode_kernel is not None
                    and span.num_tokens <= KERNEL_TAIL_ROWS):
                out[rows] = self._tail_attention(span, q[rows], k_cache, v_cache)
                continue
            qs = q[rows].transpose(0, 1).unsqueeze(0)
            if span.block_table is None and (window is None or span.num_tokens <= window):
                ks, vs = _heads_first(k[rows]), _heads_first(v[rows])
                os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                ctx = span.context_len
                if span.block_table is None:
                    ks, vs = _heads_first(k[rows]), _heads_first(v[rows])
                else:
                    ks = _heads_first(_gather_blocks(k_cache, span.block_table, q.dtype)[:ctx])
                    vs = _heads_first(_gather_blocks(v_cache, span.block_table, q.dtype)[:ctx])
                mask = window_causal_mask(span.num_tokens, ctx, window, q.device)
                os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[rows] = os_[0].transpose(0, 1)
        return out

    def _tail_attention(self, span: PrefillSpan, q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor) -> torch.Tensor:
        """Causal attention of a prefill's few rows [n, H, D] over the cached prefix and
        themselves, through the paged kernel with the rows' query positions folded into the
        kv heads' query groups: every cached K/V row is read once per chunk, in place."""
        assert self.decode_kernel is not None
        tables, lens = _kernel_rows(span)
        n, heads, dim = q.shape
        chunks, kv_heads = tables.shape[0], k_cache.shape[2]
        per, group = n // chunks, heads // kv_heads
        folded = (q.reshape(chunks, per, kv_heads, group, dim).permute(0, 2, 1, 3, 4)
                  .reshape(chunks, kv_heads * per * group, dim))
        out = self.decode_kernel(folded, k_cache, v_cache, tables, lens, dim**-0.5, tail=per)
        return (out.view(chunks, kv_heads, per, group, dim).permute(0, 2, 1, 3, 4)
                .reshape(n, heads, dim))

    def _decode_window_mask(self, meta: AttentionMetadata, window: int) -> torch.Tensor | None:
        """Boolean [num_decodes, 1, 1, max_blocks*block_size] mask of the keys each decode
        row sees through `window`; None when every row's context fits in the window."""
        if self._window_meta is not meta:
            self._window_meta, self._window_masks = meta, {}
        if window in self._window_masks:
            return self._window_masks[window]
        assert meta.decode_block_tables is not None
        if meta.decode_context_lens is not None:
            ctx = meta.decode_context_lens
        else:
            assert meta.decode_mask is not None
            ctx = (meta.decode_mask[:, 0, 0, :] == 0).sum(-1).cpu()
        mask = None
        if int(ctx.max()) > window:
            keys = torch.arange(meta.decode_block_tables.shape[1] * self.block_size)[None, :]
            ctx = ctx[:, None]
            visible = (keys < ctx) & (keys >= ctx - window)
            mask = visible[:, None, None, :].to(meta.decode_block_tables.device)
        self._window_masks[window] = mask
        return mask


def as_decode_rows(meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata | None:
    """The step as decode rows for the one-op step (kernels/decode_step.cpp), or None.

    Every prefill span must be a tail of at most `ONE_OP_TAIL_ROWS` rows over a cached
    prefix, and decode rows (if any) must carry context lengths (the CPU kernel path).
    Each tail token becomes a row with its sequence's block table and its own context
    length, position + 1 (a decode row's too): the op attends consecutive rows of one
    sequence together, reading the cached blocks once per chunk.
    """
    spans = meta.prefills
    if not spans or any(s.block_table is None or s.num_tokens > ONE_OP_TAIL_ROWS
                        for s in spans):
        return None
    nd = meta.num_decodes
    if nd and (meta.decode_context_lens is None or meta.decode_block_tables is None):
        return None
    widths = [int(s.block_table.shape[0]) for s in spans if s.block_table is not None]
    if meta.decode_block_tables is not None:
        widths.append(int(meta.decode_block_tables.shape[1]))
    tables = torch.zeros(len(positions), max(widths), dtype=torch.long)
    if nd:
        assert meta.decode_block_tables is not None
        tables[:nd, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
    for span in spans:
        assert span.block_table is not None
        tables[span.start:span.start + span.num_tokens, : span.block_table.shape[0]] = \
            span.block_table
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping, num_decodes=len(positions),
        decode_block_tables=tables, decode_mask=None, prefills=[],
        decode_context_lens=positions + 1,
    )


def _kernel_rows(span: PrefillSpan) -> tuple[torch.Tensor, torch.Tensor]:
    """The span's rows in `_tail_chunks(n)` chunks of consecutive positions: each chunk's
    block table (the span's) and the context length of its last position."""
    if span.kernel_rows is None:
        assert span.block_table is not None
        n = span.num_tokens
        chunks = _tail_chunks(n)
        per = n // chunks
        first_end = span.context_len - n + per
        span.kernel_rows = (span.block_table.cpu().expand(chunks, -1).contiguous(),
                            torch.arange(first_end, span.context_len + 1, per,
                                         dtype=torch.long))
    return span.kernel_rows


def _tail_chunks(n: int) -> int:
    """Chunks a tail of n rows is cut into: two when n is even (the kernel's work items
    are (chunk, kv head): with 3 kv heads one chunk leaves a second thread a third of the
    work), else one."""
    return 2 if n % 2 == 0 else 1


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Blocks of one layer's cache by table, as `dtype`: [n] -> [n*bs, H, D];
    [B, n] -> [B, n*bs, H, D].

    index_select on the flattened table: 1.6x faster than advanced indexing here.
    """
    rows = cache.index_select(0, block_table.reshape(-1)).to(dtype)
    if block_table.dim() == 1:
        return rows.flatten(0, 1)
    return rows.view(block_table.shape[0], -1, *cache.shape[2:])


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def resident_bytes(tensor: torch.Tensor) -> int:
    """Resident bytes of a CPU tensor's pages (mincore over its span), for memory reports."""
    if tensor.device.type != "cpu" or tensor.nbytes == 0:
        return 0
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.nbytes - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * page
