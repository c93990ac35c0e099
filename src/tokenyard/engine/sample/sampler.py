"""The sampler: one token per row of a `[B, V]` logits block (see the package docstring);
logprobs from the raw logits, masked first in rows with a grammar (see grammar.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenyard.engine.sample.filters import argmax, exp_scaled, find_kept, top_candidates
from tokenyard.engine.sample.grammar import apply_bitmask
from tokenyard.engine.sample.metadata import (
    RandomRows,
    SamplingBatch,
    index_tensor,
    random_rows,
    split_rows,
    take_rows,
)
from tokenyard.engine.sample.noise import exponential, two_level_race
from tokenyard.engine.sample.penalties import apply_penalties, penalty_rows


@dataclass
class SamplerOutput:
    """What one step sampled.

    ``logprobs[i]`` is the chosen token's raw logprob for rows that asked for logprobs and
    NaN for the others; the list is None when no row asked. ``top_logprobs[i]`` holds the
    row's k best ``(token_id, logprob)`` pairs, best first, and is ``[]`` where the row
    did not ask (or asked for k = 0).
    """

    token_ids: list[int]  # [B]
    logprobs: list[float] | None  # [B]
    top_logprobs: list[list[tuple[int, float]]] | None  # [B][k]


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits block; see the module docstring.

    The caller's logits are never modified: the sampler works on copies where it has to
    change values. Any floating dtype is accepted and computed in float32. Per-row
    branching is done on Python lists (B is small) so that a small batch costs few torch
    calls; the per-token work is batched tensor code.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample ``[B]`` tokens from ``logits`` ``[B, V]`` with each row's parameters."""
        raw = self._masked(self._check(logits, batch), logits, batch)
        processed = self.process_logits(raw, batch)
        if batch.all_greedy:
            token_ids: list[int] = argmax(processed).tolist()
        else:
            token_ids = [0] * raw.shape[0]
            greedy_rows, random_ids = split_rows(batch)
            if greedy_rows:
                best = argmax(take_rows(processed, greedy_rows)).tolist()
                for row, token in zip(greedy_rows, best, strict=True):
                    token_ids[row] = token
            self._sample_random(processed, random_rows(batch, random_ids, raw.shape[1]),
                                batch.generators, token_ids)
        logprobs, top_logprobs = self._logprobs(raw, token_ids, batch)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Apply logit bias and penalties: ``[B, V]`` in, ``[B, V]`` float32 out.

        Returns `logits` itself when no row has a bias or a penalty, otherwise a new
        tensor; the input is never written to.
        """
        raw = self._check(logits, batch)
        vocab = raw.shape[1]
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        for row, bias in enumerate(batch.logit_bias):
            for token, value in (bias or {}).items():
                if 0 <= token < vocab:
                    bias_rows.append(row)
                    bias_cols.append(token)
                    bias_vals.append(value)
        penalized = [] if batch.no_penalties else penalty_rows(batch)
        if not bias_rows and not penalized:
            return raw

        out = raw.clone()
        if bias_rows:
            index = (index_tensor(bias_rows, raw.device), index_tensor(bias_cols, raw.device))
            values = torch.tensor(bias_vals, dtype=out.dtype, device=raw.device)
            out.index_put_(index, values, accumulate=True)
        if penalized:
            apply_penalties(out, penalized, batch)
        return out

    def kept_token_ids(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> list[list[int] | None]:
        """Per row, the ascending token ids it may sample after bias, penalties and filters.

        Greedy rows give ``[argmax]``; random rows without any top-k/top-p/min-p filter
        give None (every token). Diagnostic: runs the same code as sampling.
        """
        raw = self._masked(self._check(logits, batch), logits, batch)
        vocab = raw.shape[1]
        processed = self.process_logits(raw, batch)
        greedy_rows, random_ids = split_rows(batch)
        result: list[list[int] | None] = [None] * raw.shape[0]
        if greedy_rows:
            best = argmax(take_rows(processed, greedy_rows)).tolist()
            for row, token in zip(greedy_rows, best, strict=True):
                result[row] = [token]
        params = random_rows(batch, random_ids, vocab)
        filtered = params.subset([i for i in range(len(random_ids)) if params.filtered(i, vocab)])
        for kept in find_kept(processed, filtered):
            for i, row in enumerate(kept.rows):
                result[row] = kept.ids[i, : kept.counts[i]].tolist()
        return result

    # ----------------------------------------------------------------- random rows

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        params: RandomRows,
        generators: Sequence[torch.Generator | None],
        token_ids: list[int],
    ) -> None:
        """Sample the random rows of processed `logits` [B, V] into `token_ids` [B]."""
        vocab = logits.shape[1]
        flags = [params.filtered(i, vocab) for i in range(len(params.rows))]
        plain = params.subset([i for i, f in enumerate(flags) if not f])
        filtered = params.subset([i for i, f in enumerate(flags) if f])
        if plain.rows:
            weights, _ = exp_scaled(take_rows(logits, plain.rows), plain.temperature)
            chosen = two_level_race(weights, [generators[r] for r in plain.rows]).tolist()
            for row, token in zip(plain.rows, chosen, strict=True):
                token_ids[row] = token
        for kept in find_kept(logits, filtered):
            if max(kept.counts) == 1:
                chosen = kept.ids[:, 0].tolist()
            else:
                noise = exponential(kept.counts, [generators[r] for r in kept.rows],
                                     kept.scaled)
                score = kept.scaled - noise.log_()
                if min(kept.counts) < score.shape[1]:
                    score.masked_fill_(kept.ids >= vocab, -math.inf)
                choice = score.argmax(dim=-1, keepdim=True)
                chosen = kept.ids.gather(1, choice).squeeze(1).tolist()
            for row, token in zip(kept.rows, chosen, strict=True):
                token_ids[row] = token

    # ----------------------------------------------------------------- logprobs

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, token_ids: list[int], batch: SamplingBatch
    ) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
        """Chosen-token and top-k logprobs from the raw logits, for rows that asked."""
        rows = [i for i, k in enumerate(batch.num_logprobs) if k is not None]
        if not rows:
            return None, None
        size = raw.shape[0]
        block = take_rows(raw, rows)  # [R, V]
        norm = torch.logsumexp(block, dim=-1, keepdim=True)  # [R, 1]
        chosen_index = torch.tensor([[token_ids[r]] for r in rows], device=raw.device)
        chosen = (block.gather(1, chosen_index) - norm).squeeze(1).tolist()
        chosen_list: list[float] = [math.nan] * size
        for row, value in zip(rows, chosen, strict=True):
            chosen_list[row] = value
        top: list[list[tuple[int, float]]] = [[] for _ in range(size)]
        wanted = [batch.num_logprobs[r] or 0 for r in rows]
        most = min(max(wanted), raw.shape[1])
        if most > 0:
            values, ids = top_candidates(block, most)
            values = values - norm
            for row, k, vals, toks in zip(rows, wanted, values.tolist(), ids.tolist(),
                                          strict=True):
                # A constrained row may allow fewer than k tokens: the -inf ones are left out.
                top[row] = [(t, v) for t, v in zip(toks[:k], vals[:k], strict=True)
                            if v > -math.inf]
        return chosen_list, top

    @staticmethod
    def _masked(raw: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`raw` with the grammar's disallowed tokens at -inf in the constrained rows (a
        copy when `raw` is the caller's tensor), so everything after, logprobs included,
        sees the masked distribution."""
        if batch.token_bitmask is None or not batch.bitmask_rows:
            return raw
        if raw is logits:
            raw = raw.clone()
        apply_bitmask(raw, batch.token_bitmask, batch.bitmask_rows)
        return raw

    @staticmethod
    def _check(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != batch.batch_size:
            raise ValueError(
                f"logits must be [B, V] with B = {batch.batch_size}, got {tuple(logits.shape)}"
            )
        return logits.float().contiguous()  # no copy when already float32 and contiguous
