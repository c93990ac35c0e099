"""top-k, top-p and min-p: each random row's kept set, found among its best candidates
(64, then 512, then 4096) before a full sort; argmax over blocks of 64 ids."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tokenyard.engine.sample.metadata import RandomRows, index_tensor, take_rows

# Candidate counts tried, in order, when looking for a row's top-k/top-p/min-p cut-off;
# a row not settled by the last one falls back to a full sort of its vocabulary.
CANDIDATE_LEVELS: tuple[int, ...] = (64, 512, 4096)


# Block size used to pre-select blocks before a small topk (see top_candidates).
CANDIDATE_BLOCK = 64


@dataclass
class KeptSet:
    """Tokens each of some random rows may sample, after top-k/top-p/min-p.

    ``ids`` is ``[G, W]``: each row's kept token ids in ascending order, padded with the
    vocabulary size; ``scaled`` is ``[G, W]``, the temperature-scaled logits of those ids;
    ``counts[i]`` is how many of row ``i``'s entries are real (at least 1, W at most).
    """

    rows: list[int]  # batch rows, one per tensor row
    ids: torch.Tensor
    scaled: torch.Tensor
    counts: list[int]


def find_kept(logits: torch.Tensor, params: RandomRows) -> Iterator[KeptSet]:
    """Yield the kept tokens of filtered random rows, settled level by level.

    At a level of C candidates each row's C best tokens are taken (one ``topk`` for all
    rows at that level); a row is settled when its cut-off falls inside them, i.e. when
    fewer than C survive or its top-k is at most C. Rows with a top-k wait for the first
    level at least that large (top-p renormalises over the top k, so it needs all k of
    them). The last level sorts the whole vocabulary.
    """
    if not params.rows:
        return
    device = logits.device
    vocab = logits.shape[1]
    rows = params.rows

    # Rows with top-p and no top-k renormalise over the whole vocabulary.
    lse = [0.0] * len(rows)
    needs_lse = [i for i in range(len(rows))
                 if params.top_p[i] != math.inf and params.top_k[i] == vocab]
    if needs_lse:
        weights, shift = exp_scaled(take_rows(logits, [rows[i] for i in needs_lse]),
                                     [params.temperature[i] for i in needs_lse])
        totals = (weights.sum(dim=-1).log_() + shift.squeeze(1)).tolist()
        for i, value in zip(needs_lse, totals, strict=True):
            lse[i] = value

    pending = list(range(len(rows)))  # positions into `rows`
    for width in [c for c in CANDIDATE_LEVELS if c < vocab] + [vocab]:
        level = [i for i in pending
                 if width == vocab or params.top_k[i] <= width or params.top_k[i] == vocab]
        if not level:
            continue
        block = take_rows(logits, [rows[i] for i in level])
        if width < vocab:
            values, ids = top_candidates(block, width)
        else:
            values, ids = block.sort(dim=-1, descending=True)
        columns = torch.tensor(
            [[params.temperature[i], params.top_k[i], params.top_p[i], params.log_min_p[i],
              lse[i]] for i in level],
            dtype=torch.float32, device=device,
        )  # [G, 5]
        scaled = values / columns[:, 0:1]
        keep = keep_prefix(
            scaled,
            columns,
            use_top_k=any(params.top_k[i] < width for i in level),
            use_top_p=any(params.top_p[i] != math.inf for i in level),
            use_min_p=any(params.log_min_p[i] > -math.inf for i in level),
        )
        counts: list[int] = keep.sum(dim=-1).tolist()
        done = [j for j, i in enumerate(level) if counts[j] < width or params.top_k[i] <= width]
        if done:
            if len(done) < len(level):
                pick = index_tensor(done, device)
                ids, scaled, keep = ids[pick], scaled[pick], keep[pick]
            yield canonical([rows[level[j]] for j in done], ids, scaled, keep,
                             [counts[j] for j in done], vocab)
        finished = {level[j] for j in done}
        pending = [i for i in pending if i not in finished]
        if not pending:
            break


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` ``[G]`` for ``[G, V]``, ties to the lowest id, done in two steps.

    Block maxima over blocks of 64 ids, then the first block holding the row maximum,
    then the first maximum inside it: the same answer as ``torch.argmax`` (which returns
    the first maximal index) at a fraction of its CPU cost.
    """
    size, vocab = x.shape
    block = CANDIDATE_BLOCK
    if vocab % block or vocab < 8 * block:
        return x.argmax(dim=-1)
    blocks = x.view(size, vocab // block, block)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [G]
    inside = blocks[torch.arange(size, device=x.device), best].argmax(dim=-1)
    return best * block + inside


def top_candidates(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest values of each row of `x` ``[G, V]``, descending, and their ids.

    Same values as ``x.topk(width)`` (ids may differ only among equal values), but for
    small widths it first keeps the `width` blocks of 64 ids with the largest maxima,
    which must hold the `width` largest values, so the exact topk runs on
    ``width * 64`` values instead of V.
    """
    size, vocab = x.shape
    block = CANDIDATE_BLOCK
    if vocab % block or width * block * 4 > vocab:
        return x.topk(width, dim=-1)
    blocks = x.view(size, vocab // block, block)
    _, best = blocks.amax(dim=-1).topk(width, dim=-1)  # [G, width] block indices
    rows = torch.arange(size, device=x.device).unsqueeze(1)
    pool = blocks[rows, best].reshape(size, width * block)
    values, local = pool.topk(width, dim=-1)
    ids = best.gather(1, local // block) * block + local % block
    return values, ids


def exp_scaled(
    x: torch.Tensor, temperature: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(x / T - shift)`` ``[G, V]`` and ``shift = max(x) / T`` ``[G, 1]``, per row.

    Shifting by the row maximum keeps exp() in range; the weights are unnormalised.
    """
    peak = x.amax(dim=-1, keepdim=True)
    if all(t == 1.0 for t in temperature):
        return (x - peak).exp_(), peak
    inverse = 1.0 / torch.tensor(temperature, dtype=x.dtype, device=x.device).unsqueeze(1)
    shift = peak * inverse
    return torch.addcmul(-shift, x, inverse).exp_(), shift


def keep_prefix(
    scaled: torch.Tensor, columns: torch.Tensor, use_top_k: bool, use_top_p: bool,
    use_min_p: bool,
) -> torch.Tensor:
    """Which sorted candidates survive top-k, then top-p, then min-p.

    `scaled` is ``[G, C]``, temperature-scaled logits sorted descending; `columns` is
    ``[G, 5]``: temperature, effective top-k, top-p (inf: off), log(min-p) (-inf: off) and
    the row's full-vocabulary log-normaliser (used by top-p rows without a top-k). The
    ``use_*`` flags say whether any row has that filter within C. Returns a bool
    ``[G, C]`` mask, a non-empty prefix of each row.
    """
    width = scaled.shape[1]
    top_k = columns[:, 1:2]
    if use_top_k:
        keep = torch.arange(width, device=scaled.device).unsqueeze(0) < top_k
    else:
        keep = torch.ones_like(scaled, dtype=torch.bool)
    if use_top_p:
        norm = columns[:, 4:5]
        if use_top_k:
            top_k_lse = torch.logsumexp(scaled.masked_fill(~keep, -math.inf), dim=-1,
                                        keepdim=True)
            norm = torch.where(top_k <= width, top_k_lse, norm)
        # Rows without top-p normalise by their best logit so exp() cannot overflow.
        norm = torch.where(columns[:, 2:3] == math.inf, scaled[:, :1], norm)
        probs = (scaled - norm).exp_()
        if use_top_k:
            probs.masked_fill_(~keep, 0.0)
        before = probs.cumsum(dim=-1).sub_(probs)  # mass of the better tokens
        keep &= before < columns[:, 2:3]
    if use_min_p:
        # p_i >= min_p * p_max  <=>  scaled_i >= scaled_max + log(min_p). Top-k and top-p
        # keep the best token, so renormalising after them does not move the threshold.
        keep &= scaled >= scaled[:, :1] + columns[:, 3:4]
    keep[:, 0] = True
    return keep


def canonical(
    rows: list[int],
    ids: torch.Tensor,
    scaled: torch.Tensor,
    keep: torch.Tensor,
    counts: list[int],
    vocab: int,
) -> KeptSet:
    """Reorder each row's kept candidates (a prefix of `keep`, ``[G, C]``) by token id.

    Token id order makes a seeded row's noise land on the same tokens however the
    candidate search ordered equal logits.
    """
    width = max(counts)
    if width == 1:
        return KeptSet(rows=rows, ids=ids[:, :1], scaled=scaled[:, :1], counts=counts)
    kept_ids = torch.where(keep[:, :width], ids[:, :width], vocab)
    sorted_ids, order = kept_ids.sort(dim=-1)
    return KeptSet(rows=rows, ids=sorted_ids, scaled=scaled[:, :width].gather(1, order),
                    counts=counts)
