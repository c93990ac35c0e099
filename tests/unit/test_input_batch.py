"""The runner's persistent batch (engine/input_batch.py): rows kept across steps, block
tables updated by differences, and each step's inputs equal to those computed afresh
from the KV manager's tables."""

from __future__ import annotations

import random

import pytest
import torch

from tokenyard.engine.input_batch import BlockTables, InputBatch, PreparedStep
from tokenyard.engine.kv_cache import KVBlock, KVCacheManager
from tokenyard.engine.request import Request
from tokenyard.engine.scheduler import Scheduler, SchedulerOutput
from tokenyard.wire.sampling_params import SamplingParams

CPU = torch.device("cpu")


def blocks(*ids: int) -> list[KVBlock]:
    return [KVBlock(i) for i in ids]


def device_rows(tables: BlockTables) -> list[list[int]]:
    """The device's table after its pending writes, as lists."""
    writes = tables.take_pending()
    if writes:
        tables.apply([torch.from_numpy(w) for w in writes])
    return tables.table.tolist()


def test_a_row_is_kept_and_only_the_blocks_added_since_are_written() -> None:
    tables = BlockTables(2, 4, CPU, shared=False)
    mine = blocks(5, 6)
    row = tables.row("a", mine)
    assert device_rows(tables)[row][:2] == [5, 6]
    assert tables.row("a", mine) == row and tables.take_pending() == []  # nothing new
    mine.append(KVBlock(9))
    assert tables.row("a", mine) == row
    rows, cols, ids = tables.take_pending()
    assert (rows.tolist(), cols.tolist(), ids.tolist()) == ([row], [2], [9])


def test_a_freed_row_is_reused_and_a_request_allocated_again_is_rewritten() -> None:
    tables = BlockTables(2, 4, CPU, shared=False)
    a, b = tables.row("a", blocks(1, 2)), tables.row("b", blocks(3))
    tables.release(["a", "unknown"])
    assert tables.row("c", blocks(7)) == a
    # b's blocks were freed and allocated anew (another list): its row is rewritten.
    assert tables.row("b", blocks(4, 8)) == b
    table = device_rows(tables)
    assert table[a][:1] == [7] and table[b][:2] == [4, 8]


def test_the_tables_grow_past_their_first_rows_and_blocks() -> None:
    for shared in (True, False):
        tables = BlockTables(1, 1, CPU, shared=shared)
        lists = {f"r{i}": blocks(*range(10 * i, 10 * i + 3 + i)) for i in range(5)}
        rows = {rid: tables.row(rid, bl) for rid, bl in lists.items()}
        table = device_rows(tables)
        assert len(set(rows.values())) == len(rows)
        for rid, bl in lists.items():
            assert table[rows[rid]][:len(bl)] == [b.block_id for b in bl]
        assert table == tables.host.tolist()


def _request(rid: str, prompt: int, out: int, rng: random.Random) -> Request:
    return Request(rid, [rng.randrange(1, 500) for _ in range(prompt)],
                   SamplingParams(max_tokens=out, ignore_eos=True))


def _check(step: SchedulerOutput, prepared: PreparedStep, kv: KVCacheManager) -> None:
    """`prepared` against the inputs computed from scratch: decode rows first, each row's
    position and slot from its request's block ids now, and pending tokens as fills."""
    bs = kv.block_size
    items = sorted(step.scheduled, key=lambda item: item[1] > 1)
    meta = prepared.meta
    nd = sum(1 for _, n in items if n == 1)
    assert meta.num_decodes == nd
    positions, slots, tokens, fills = [], [], [], []
    spans = iter(meta.prefills)
    for i, (request, n) in enumerate(items):
        start = step.starts[request.request_id]
        table = kv.block_ids(request.request_id)
        if n == 1:
            ctx_blocks = start // bs + 1
            assert meta.decode_block_tables is not None
            assert meta.decode_block_tables[i, :ctx_blocks].tolist() == table[:ctx_blocks]
        else:
            span = next(spans)
            assert (span.start, span.num_tokens, span.context_len) == (
                len(positions), n, start + n)
            if start == 0:
                assert span.block_table is None
            else:
                assert span.block_table is not None
                assert span.block_table.tolist() == table[: -(-(start + n) // bs)]
        for p in range(start, start + n):
            if p < len(request.all_token_ids):
                tokens.append(request.all_token_ids[p])
            else:
                fills.append((len(positions), request.request_id))
                tokens.append(0)
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
    assert prepared.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert prepared.input_ids.tolist() == tokens
    got = [] if prepared.fill_rows is None else prepared.fill_rows.tolist()
    assert list(zip(got, prepared.fill_ids, strict=True)) == fills
    if nd:
        assert meta.decode_context_lens is not None
        assert meta.decode_context_lens.tolist() == [step.starts[r.request_id] + 1
                                                     for r, _ in items[:nd]]


@pytest.mark.parametrize("in_flight", [False, True])
def test_every_step_matches_the_inputs_made_afresh(in_flight: bool) -> None:
    """Arrivals, chunked prompts, prefix hits, preemption in a short pool and finished
    requests, with and without a step in flight (its tokens pending): the persistent
    batch, its device table kept apart and small enough to grow, gives each step the
    inputs computed from the KV manager's tables."""
    rng = random.Random(1 if in_flight else 0)
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_num_batched_tokens=24, prefill_chunk=12, max_num_seqs=6)
    batch = InputBatch(kv, CPU, max_num_seqs=2, max_model_len=8)
    batch.tables = BlockTables(2, 2, CPU, shared=False)
    shared_prefix = [7] * 9
    pending: SchedulerOutput | None = None
    preempted = 0
    for t in range(120):
        if t < 60 and rng.random() < 0.5:
            request = _request(f"r{t}", rng.randrange(2, 20), rng.randrange(1, 12), rng)
            if rng.random() < 0.3:
                request.prompt_token_ids = shared_prefix + request.prompt_token_ids
                request.all_token_ids = list(request.prompt_token_ids)
            scheduler.add_request(request)
        step = scheduler.schedule()
        preempted += len(step.preempted)
        if not step.is_empty:
            _check(step, batch.prepare(step, masks=False), kv)
            # Rows of finished and preempted requests were given back.
            assert batch.tables.num_rows_held <= len(scheduler.running)
        done, pending = (pending, step) if in_flight else (step, None)
        if done is not None:
            scheduler.update(done, {rid: rng.randrange(1, 500) for rid in done.sampling})
    assert preempted > 0, "the pool was never short: the test lost its point"


def test_decode_rows_get_a_mask_where_no_kernel_reads_them() -> None:
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_num_batched_tokens=64)
    rng = random.Random(3)
    for rid, length in (("a", 6), ("b", 2)):
        scheduler.add_request(_request(rid, length, 4, rng))
    batch = InputBatch(kv, CPU, max_num_seqs=4, max_model_len=64)
    first = scheduler.schedule()
    scheduler.update(first, dict.fromkeys(first.sampling, 9))
    step = scheduler.schedule()
    meta = batch.prepare(step, masks=True).meta
    assert meta.decode_context_lens is None and meta.decode_mask is not None
    visible = (meta.decode_mask[:, 0, 0, :] == 0).sum(-1).tolist()
    assert visible == [7, 3]  # each row sees its context: its tokens and the one it adds
