"""Repetition, frequency and presence penalties, applied only at the `row * V + token`
positions that occurred, so their cost follows the token counts, not `B * V`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from tokenyard.engine.sample.metadata import SamplingBatch


def penalty_rows(batch: SamplingBatch) -> list[int]:
    """The rows with any penalty."""
    rows = zip(batch.values("presence_penalty"), batch.values("frequency_penalty"),
               batch.values("repetition_penalty"), strict=True)
    return [i for i, (pres, freq, rep) in enumerate(rows)
            if pres != 0.0 or freq != 0.0 or rep != 1.0]


def apply_penalties(out: torch.Tensor, rows: list[int], batch: SamplingBatch) -> None:
    """Apply repetition, frequency and presence penalties to `rows` of `out` in place.

    Works on the flat positions ``row * V + token`` of the tokens that occurred, so the
    cost follows the number of prompt/output tokens, not ``P * V``.
    """
    device = out.device
    vocab = out.shape[1]
    flat = out.view(-1)
    rep = batch.values("repetition_penalty")

    outputs = flat_positions([batch.output_token_ids[r] for r in rows], rows, vocab)
    rep_rows = [r for r in rows if rep[r] != 1.0]
    if rep_rows:
        # Repetition: every token seen in the prompt or the output, once each.
        prompts = flat_positions([batch.prompt_token_ids[r] for r in rep_rows], rep_rows, vocab)
        seen = torch.unique(torch.cat([prompts, outputs])).to(device)
        penalty = batch.repetition_penalty.index_select(0, seen // vocab)
        active = penalty != 1.0
        seen, penalty = seen[active], penalty[active]
        values = flat.index_select(0, seen)
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if outputs.numel():
        # Frequency and presence: output tokens only.
        positions, counts = torch.unique(outputs, return_counts=True)
        positions = positions.to(device)
        row_of = positions // vocab
        values = flat.index_select(0, positions)
        flat[positions] = (
            values
            - batch.frequency_penalty.index_select(0, row_of) * counts.to(device, torch.float32)
            - batch.presence_penalty.index_select(0, row_of)
        )


def flat_positions(
    sequences: Sequence[Sequence[int]], rows: list[int], vocab: int
) -> torch.Tensor:
    """``row * V + token`` (CPU int64) for every token of every sequence; ids >= V dropped.

    A sequence may be a list of ints or a 1-D int64 tensor (used without copying).
    """
    if any(isinstance(seq, torch.Tensor) for seq in sequences):
        parts = [torch.as_tensor(seq, dtype=torch.int64).reshape(-1).cpu() for seq in sequences]
        tokens = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        lengths = torch.tensor([part.numel() for part in parts], dtype=torch.int64)
    else:  # one conversion for all the lists
        tokens = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.int64)
        lengths = torch.tensor([len(seq) for seq in sequences], dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    valid = (tokens >= 0) & (tokens < vocab)
    return row_of[valid] * vocab + tokens[valid]
