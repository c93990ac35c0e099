"""The runner's persistent batch: a row per running request, kept from step to step.

A step writes only what changed since the one before: a request new to the batch takes a
free row, a request freed since (finished or preempted, `SchedulerOutput.freed`) gives its
row back, and a row's block table gains the blocks allocated since (a request's table only
grows until it is freed: kv_cache.py). The block tables are one `[rows, blocks]` tensor on
the model's device, updated by those differences; a step's decode rows are one
`index_select` of it. The step's flat inputs (token ids, positions, slot mapping, context
lengths, the rows to sample) are numpy arrays built over the rows and sent to the device
in one copy, so the host's work per running sequence is a few list appends, not a few
torch calls.

A row's entries past its request's blocks are stale block ids (of a request that held the
row before, or zeros): valid indices of the pool, which the attention reads only up to a
row's context length (the kernels) or masks (the torch path).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenyard.engine.kv_cache import KVBlock, KVCacheManager
from tokenyard.engine.paged_attention import AttentionMetadata, PrefillSpan
from tokenyard.engine.request import Request
from tokenyard.engine.sample.prompt_logprobs import PromptSpan, prompt_span
from tokenyard.engine.step_plan import SchedulerOutput
from tokenyard.engine.to_device import to_device


@dataclass
class PreparedStep:
    """A scheduled step as tensors, ready for `ModelRunner.run`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # the rows whose hidden state is sampled
    sample_requests: list[Request]
    #: The rows of `input_ids` that are the token the step before sampled (async), on the
    #: device, and their requests' ids; None when there are none.
    fill_rows: torch.Tensor | None = None
    fill_ids: list[str] = field(default_factory=list)
    #: `sample_rows` on the device; None when every row is sampled, in order.
    sample_index: torch.Tensor | None = None
    #: Prefill rows to score against the next prompt token (prompt logprobs).
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    #: Per speculating request: its drafts (its rows in `sample_rows` are consecutive).
    drafts: dict[str, list[int]] = field(default_factory=dict)
    #: Each token row's LoRA slot (0: none) on the device; None when no row is adapted.
    lora_slots: torch.Tensor | None = None
    #: Adapters to write into their slots before the step runs (engine/lora/manager.py).
    lora_writes: list[Any] = field(default_factory=list)


class BlockTables:
    """Every row's block ids: a host copy (numpy) and the device's tensor, which is the
    same memory on the CPU and is updated by differences elsewhere."""

    def __init__(self, rows: int, cols: int, device: torch.device,
                 shared: bool | None = None) -> None:
        """`shared`: the device's table is the host copy's memory (default: on the CPU);
        False keeps a table apart, updated by differences as on CUDA (tests)."""
        self.device = device
        self.shared = device.type == "cpu" if shared is None else shared
        self.host = np.zeros((max(rows, 1), max(cols, 1)), dtype=np.int64)
        self.table = self._device_copy()
        #: request id -> (its row, the kv manager's block list the row mirrors)
        self._rows: dict[str, tuple[int, list[KVBlock]]] = {}
        self._known = [0] * self.host.shape[0]  # blocks written per row
        self._free = list(range(self.host.shape[0] - 1, -1, -1))  # a stack, low rows first
        # Writes not yet on the device (CUDA only): rows, columns, block ids.
        self._pending: tuple[list[int], list[int], list[int]] = ([], [], [])

    @property
    def num_rows_held(self) -> int:
        return len(self._rows)

    def release(self, request_ids: Iterable[str]) -> None:
        """Give the rows of `request_ids` back (unknown ids are ignored)."""
        for request_id in request_ids:
            entry = self._rows.pop(request_id, None)
            if entry is not None:
                self._known[entry[0]] = 0
                self._free.append(entry[0])

    def row(self, request_id: str, blocks: list[KVBlock]) -> int:
        """The row of `request_id`, its table brought up to `blocks` (the kv manager's
        list for it: another list than the row's means the request was freed and
        allocated again since, and the row is rewritten)."""
        entry = self._rows.get(request_id)
        if entry is None or entry[1] is not blocks:
            row = entry[0] if entry is not None else self._take_row()
            self._rows[request_id] = (row, blocks)
            known = 0
        else:
            row = entry[0]
            known = self._known[row]
        count = len(blocks)
        if count > known:
            if count > self.host.shape[1]:
                self._grow(self.host.shape[0], max(count, 2 * self.host.shape[1]))
            ids = [b.block_id for b in blocks[known:]]
            self.host[row, known:count] = ids
            if not self.shared:
                rows, cols, values = self._pending
                rows.extend([row] * len(ids))
                cols.extend(range(known, count))
                values.extend(ids)
            self._known[row] = count
        return row

    def take_pending(self) -> list[np.ndarray]:
        """The writes the device's table still lacks, as (rows, columns, ids) arrays, for
        `apply` once they are on the device; [] when the memory is shared."""
        rows, cols, values = self._pending
        if not rows:
            return []
        self._pending = ([], [], [])
        return [np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64),
                np.array(values, dtype=np.int64)]

    def apply(self, writes: list[torch.Tensor]) -> None:
        """Write `take_pending`'s arrays, now on the device, into its table."""
        rows, cols, values = writes
        self.table.index_put_((rows, cols), values)

    def _take_row(self) -> int:
        if not self._free:
            self._grow(2 * self.host.shape[0], self.host.shape[1])
        return self._free.pop()

    def _grow(self, rows: int, cols: int) -> None:
        """Room for `rows` x `cols`, keeping what is written. The device's table is
        replaced: earlier steps hold copies of its rows, never views."""
        old_rows, old_cols = self.host.shape
        host = np.zeros((rows, cols), dtype=np.int64)
        host[:old_rows, :old_cols] = self.host
        self.host = host
        if self.shared:
            self.table = self._device_copy()
        else:
            table = torch.zeros((rows, cols), dtype=torch.long, device=self.device)
            table[:old_rows, :old_cols] = self.table
            self.table = table
        self._known += [0] * (rows - old_rows)
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free

    def _device_copy(self) -> torch.Tensor:
        if self.shared:
            return torch.from_numpy(self.host)  # the same memory
        return torch.from_numpy(self.host.copy()).to(self.device)


class InputBatch:
    """Builds each scheduled step's inputs over the persistent rows (see the module)."""

    def __init__(self, kv: KVCacheManager, device: torch.device, *, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        cols = min(kv.num_blocks, kv.blocks_needed(max_model_len))
        self.tables = BlockTables(max_num_seqs, cols, device)

    def prepare(self, step: SchedulerOutput, *, masks: bool,
                lora: bool = False) -> PreparedStep:
        """The step's flat inputs: single-token rows first (the attention batches them
        together), then each prefill span. With async scheduling a token still being
        sampled is a placeholder here (`fill_rows`), which the runner fills in. `masks`:
        decode rows get an additive mask (no paged kernel reads them), else their
        context lengths. `lora`: a running request holds an adapter, and each token row
        gets its request's slot (`PreparedStep.lora_slots`)."""
        bs = self.block_size
        tables = self.tables
        tables.release(step.freed)
        kv_tables = self.kv.block_tables
        starts, sampling = step.starts, step.sampling
        ids: list[int] = []  # decode rows' tokens, then prefills'
        rows: list[int] = []  # the decode rows' rows in the tables
        positions: list[int] = []  # the decode rows'
        fill_at: list[int] = []
        fill_ids: list[str] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        spans: list[PromptSpan] = []
        prefills: list[tuple[Request, int, int, int]] = []  # request, row, start, n
        lora_slots: list[int] = []  # with `lora`: the decode rows', then each prefill's
        for request, n in step.scheduled:
            request_id = request.request_id
            row = tables.row(request_id, kv_tables[request_id])
            if n > 1:
                prefills.append((request, row, starts[request_id], n))
                continue
            start = starts[request_id]
            tokens = request.all_token_ids
            if start < len(tokens):
                ids.append(tokens[start])
            else:  # the pending token of the step in flight
                fill_at.append(len(ids))
                fill_ids.append(request_id)
                ids.append(0)
            if request.scores_prompt:
                self._score(request, len(rows), start, 1, spans)
            if request_id in sampling:
                sample_rows.append(len(rows))
                sample_requests.append(request)
            rows.append(row)
            positions.append(start)
            if lora:
                lora_slots.append(request.lora_slot)
        num_decodes = len(rows)
        decode_rows = np.array(rows, dtype=np.int64)
        decode_pos = np.array(positions, dtype=np.int64)
        host = tables.host
        parts = [decode_pos, host[decode_rows, decode_pos // bs] * bs + decode_pos % bs]
        spans_at: list[tuple[int, int, int, int]] = []  # first row, n, context, row
        drafts = step.drafts
        for request, row, start, n in prefills:
            first = len(ids)
            mine = drafts.get(request.request_id, ())  # a decode row verifying drafts
            known = request.all_token_ids[start:start + n - len(mine)]
            known.extend(mine)
            if len(known) < n:  # the one pending token at a prompt's end
                fill_at.append(first + len(known))
                fill_ids.append(request.request_id)
                known.append(0)
            ids.extend(known)
            if lora:
                lora_slots.extend([request.lora_slot] * n)
            pos = np.arange(start, start + n, dtype=np.int64)
            parts += [pos, host[row, pos // bs] * bs + pos % bs]
            spans_at.append((first, n, start + n, row if start else -1))
            if request.scores_prompt:
                self._score(request, first, start, n, spans)
            if request.request_id in sampling:
                # A row that verifies drafts samples every position it computes.
                width = len(mine) + 1
                sample_rows.extend(range(first + n - width, first + n))
                sample_requests.extend([request] * width)
        total = len(ids)
        sampled_all = sample_rows == list(range(total))
        arrays = [np.array(ids, dtype=np.int64),
                  np.concatenate(parts[0::2]), np.concatenate(parts[1::2]),
                  decode_rows, decode_pos + 1,
                  np.array(fill_at, dtype=np.int64),
                  np.array([] if sampled_all else sample_rows, dtype=np.int64),
                  np.array(lora_slots if any(lora_slots) else [], dtype=np.int64),
                  *tables.take_pending()]
        (input_ids, pos_t, slots, rows_t, context_lens, fill_rows, sample_index,
         lora_t, *writes) = _send(arrays, self.device)
        if writes:
            tables.apply(writes)
        meta = AttentionMetadata(
            slot_mapping=slots, num_decodes=num_decodes, decode_block_tables=None,
            decode_mask=None, prefills=[
                PrefillSpan(start=first, num_tokens=n, context_len=ctx,
                            block_table=None if row < 0
                            else tables.table[row, : -(-ctx // bs)].clone())
                for first, n, ctx, row in spans_at])
        if num_decodes:
            width = int(decode_pos.max()) // bs + 1
            meta.decode_block_tables = torch.index_select(
                tables.table[:, :width], 0, rows_t)
            if masks:
                keys = torch.arange(width * bs, device=self.device)
                visible = keys[None, :] < context_lens[:, None]
                meta.decode_mask = torch.zeros(visible.shape, device=self.device).masked_fill_(
                    ~visible, float("-inf"))[:, None, None, :]
            else:
                meta.decode_context_lens = context_lens
        return PreparedStep(
            input_ids, pos_t, meta, sample_rows, sample_requests,
            fill_rows if fill_ids else None, fill_ids,
            None if sampled_all else sample_index, spans, drafts,
            lora_t if len(lora_t) else None)

    @staticmethod
    def _score(request: Request, row: int, start: int, n: int,
               spans: list[PromptSpan]) -> None:
        span = prompt_span(request.request_id, request.prompt_token_ids,
                           request.params.prompt_logprobs, row, start, n,
                           len(request.prompt_logprobs))
        if span is not None:
            spans.append(span)


def _send(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """`arrays` (int64, 1-D) as tensors on `device`: views of one block, one copy there."""
    flat = to_device(torch.from_numpy(np.concatenate(arrays)), device)
    return list(flat.split([len(a) for a in arrays]))
