"""Batched token sampling: logit bias, penalties, temperature, top-k/top-p/min-p, logprobs.

One engine step hands the sampler a ``[B, V]`` block of next-token logits, one row per
sequence being sampled, and a :class:`SamplingBatch` holding each row's parameters. The
semantics follow the OpenAI API as vLLM implements it:

1. ``logit_bias`` is added to the raw logits.
2. Penalties: repetition (prompt and output tokens; positive logits are divided by the
   penalty, negative ones multiplied), then frequency (``- freq * count``) and presence
   (``- presence * (count > 0)``), both counted over output tokens only.
3. Greedy rows (temperature < 1e-5) take the argmax of the processed logits; ties go to
   the lowest token id.
4. Random rows divide by their temperature, keep the top-k tokens, then the smallest
   prefix of those whose renormalised mass reaches top-p, then the tokens whose
   probability is at least ``min_p`` times the largest, and sample from what is left.
5. Logprobs (chosen token and top-k alternatives) come from ``log_softmax`` of the RAW
   logits, before bias, penalties, temperature and filters.

Sampling is an exponential race: the winner is ``argmax_i p_i / E_i`` with ``E_i``
i.i.d. Exponential(1), which picks token ``i`` with probability ``p_i``. A row with its
own seeded generator draws its ``E`` from it, a number of values and an order (token id
order) fixed by the row alone, so a seeded request gets the same tokens whatever else is
in the batch and wherever its row sits. Rows without a generator share one draw from
torch's global RNG.

Cost notes (CPU, V ~ 50k): torch's CPU RNG and ``topk``/``sort`` are slow per element,
so the sampler avoids full-vocabulary noise and sorts:

* rows without filters race in two rounds, first between blocks of 256 ids (weighted by
  block mass), then inside the winning block: V/256 + 256 noise values, still exact;
* filtered rows look for their cut-off among their 64 best tokens, then 512, then 4096,
  and only a row whose kept set is larger still pays for a full sort; they race only
  over the tokens they keep;
* argmax and small top-k pre-select blocks of 64 ids by their maxima.

Penalties touch only the ``row * V + token`` positions that occurred, so their cost
follows the number of prompt/output tokens, not ``B * V``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tokenyard.wire.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (as vLLM does), to avoid dividing by ~0.
GREEDY_TEMPERATURE_EPS = 1e-5

# Candidate counts tried, in order, when looking for a row's top-k/top-p/min-p cut-off;
# a row not settled by the last one falls back to a full sort of its vocabulary.
_CANDIDATE_LEVELS: tuple[int, ...] = (64, 512, 4096)

# Block size of the two-level race used by rows without filters.
_RACE_BLOCK = 256

# Block size used to pre-select blocks before a small topk (see _top_candidates).
_CANDIDATE_BLOCK = 64


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` seeded with `seed`, for one request's sampling noise."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingBatch:
    """Per-row sampling state for one step; built by the engine's runner.

    All tensors are ``[B]`` and, like the generators, on the logits' device (see
    ``make_generator``). The fast-path flags must agree with the tensors (``from_params``
    computes them); ``no_top_k``/``no_top_p``/``no_min_p`` look at random rows only,
    since greedy rows ignore those filters. A ``logit_bias`` entry
    may be ``-inf`` (the runner can use that to ban tokens, e.g. EOS before
    ``min_tokens``); ids outside the vocabulary are ignored.
    """

    temperature: torch.Tensor  # [B] float32; < GREEDY_TEMPERATURE_EPS means greedy
    top_p: torch.Tensor  # [B] float32 in (0, 1]
    top_k: torch.Tensor  # [B] int64; <= 0 (or >= vocab) disables
    min_p: torch.Tensor  # [B] float32 in [0, 1]
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32; 1 disables
    logit_bias: list[dict[int, float] | None]
    generators: list[torch.Generator | None]  # per-row seeded generator, or None
    prompt_token_ids: Sequence[Sequence[int]]  # repetition penalty: prompt + output
    output_token_ids: Sequence[Sequence[int]]  # presence/frequency: output only
    # (each row a list of ints or a 1-D int64 tensor, e.g. one the runner caches)
    num_logprobs: list[int | None]  # None: no logprobs; k: chosen token plus top k
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Gather the rows' parameters into tensors and work out the fast-path flags.

        `generators`, `prompt_token_ids` and `output_token_ids` are one entry per row
        (defaults: no generator, no tokens). Token id lists are kept by reference.
        """
        size = len(params)
        gens: list[torch.Generator | None] = (
            list(generators) if generators is not None else [None] * size
        )
        prompts = prompt_token_ids if prompt_token_ids is not None else [[]] * size
        outputs = output_token_ids if output_token_ids is not None else [[]] * size
        if not (len(gens) == len(prompts) == len(outputs) == size):
            raise ValueError(
                f"row count mismatch: {size} params, {len(gens)} generators, "
                f"{len(prompts)} prompts, {len(outputs)} outputs"
            )

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        temperature = [p.temperature for p in params]
        random_rows = [p for p, t in zip(params, temperature, strict=True)
                       if t >= GREEDY_TEMPERATURE_EPS]
        return cls(
            temperature=floats(temperature),
            top_p=floats([p.top_p for p in params]),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            min_p=floats([p.min_p for p in params]),
            presence_penalty=floats([p.presence_penalty for p in params]),
            frequency_penalty=floats([p.frequency_penalty for p in params]),
            repetition_penalty=floats([p.repetition_penalty for p in params]),
            logit_bias=[p.logit_bias or None for p in params],
            generators=gens,
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            num_logprobs=[p.logprobs for p in params],
            all_greedy=not random_rows,
            all_random=len(random_rows) == size,
            no_penalties=all(
                p.presence_penalty == 0.0
                and p.frequency_penalty == 0.0
                and p.repetition_penalty == 1.0
                for p in params
            ),
            no_top_k=all(p.top_k <= 0 for p in random_rows),
            no_top_p=all(p.top_p >= 1.0 for p in random_rows),
            no_min_p=all(p.min_p <= 0.0 for p in random_rows),
        )


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


@dataclass
class _RandomRows:
    """Python-side parameters of some random rows (cheap to branch on, one entry per row).

    ``top_k`` is the effective k (the vocabulary size when disabled), ``top_p`` is ``inf``
    when disabled, and ``log_min_p`` is ``-inf`` when disabled.
    """

    rows: list[int]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    log_min_p: list[float]

    def filtered(self, i: int, vocab: int) -> bool:
        return self.top_k[i] < vocab or self.top_p[i] != math.inf or self.log_min_p[i] > -math.inf

    def subset(self, positions: list[int]) -> _RandomRows:
        return _RandomRows(
            rows=[self.rows[i] for i in positions],
            temperature=[self.temperature[i] for i in positions],
            top_k=[self.top_k[i] for i in positions],
            top_p=[self.top_p[i] for i in positions],
            log_min_p=[self.log_min_p[i] for i in positions],
        )


@dataclass
class _KeptSet:
    """Tokens each of some random rows may sample, after top-k/top-p/min-p.

    ``ids`` is ``[G, W]``: each row's kept token ids in ascending order, padded with the
    vocabulary size; ``scaled`` is ``[G, W]``, the temperature-scaled logits of those ids;
    ``counts[i]`` is how many of row ``i``'s entries are real (at least 1, W at most).
    """

    rows: list[int]  # batch rows, one per tensor row
    ids: torch.Tensor
    scaled: torch.Tensor
    counts: list[int]


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits block; see the module docstring.

    The caller's logits are never modified: the sampler works on copies where it has to
    change values. Any floating dtype is accepted and computed in float32. Per-row
    branching is done on Python lists (B is small) so that a small batch costs few torch
    calls; the per-token work is batched tensor code.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample ``[B]`` tokens from ``logits`` ``[B, V]`` with each row's parameters."""
        raw = self._check(logits, batch)
        processed = self.process_logits(raw, batch)
        if batch.all_greedy:
            token_ids: list[int] = _argmax(processed).tolist()
        else:
            token_ids = [0] * raw.shape[0]
            greedy_rows, random_rows = _split_rows(batch)
            if greedy_rows:
                argmax = _argmax(_take_rows(processed, greedy_rows)).tolist()
                for row, token in zip(greedy_rows, argmax, strict=True):
                    token_ids[row] = token
            self._sample_random(processed, _random_rows(batch, random_rows, raw.shape[1]),
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
        penalty_rows = [] if batch.no_penalties else _penalty_rows(batch)
        if not bias_rows and not penalty_rows:
            return raw

        out = raw.clone()
        if bias_rows:
            index = (_index(bias_rows, raw.device), _index(bias_cols, raw.device))
            values = torch.tensor(bias_vals, dtype=out.dtype, device=raw.device)
            out.index_put_(index, values, accumulate=True)
        if penalty_rows:
            _apply_penalties(out, penalty_rows, batch)
        return out

    def kept_token_ids(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> list[list[int] | None]:
        """Per row, the ascending token ids it may sample after bias, penalties and filters.

        Greedy rows give ``[argmax]``; random rows without any top-k/top-p/min-p filter
        give None (every token). Diagnostic: runs the same code as sampling.
        """
        raw = self._check(logits, batch)
        vocab = raw.shape[1]
        processed = self.process_logits(raw, batch)
        greedy_rows, random_rows = _split_rows(batch)
        result: list[list[int] | None] = [None] * raw.shape[0]
        if greedy_rows:
            argmax = _argmax(_take_rows(processed, greedy_rows)).tolist()
            for row, token in zip(greedy_rows, argmax, strict=True):
                result[row] = [token]
        params = _random_rows(batch, random_rows, vocab)
        filtered = params.subset([i for i in range(len(random_rows)) if params.filtered(i, vocab)])
        for kept in _find_kept(processed, filtered):
            for i, row in enumerate(kept.rows):
                result[row] = kept.ids[i, : kept.counts[i]].tolist()
        return result

    # ----------------------------------------------------------------- random rows

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        params: _RandomRows,
        generators: Sequence[torch.Generator | None],
        token_ids: list[int],
    ) -> None:
        """Sample the random rows of processed `logits` [B, V] into `token_ids` [B]."""
        vocab = logits.shape[1]
        flags = [params.filtered(i, vocab) for i in range(len(params.rows))]
        plain = params.subset([i for i, f in enumerate(flags) if not f])
        filtered = params.subset([i for i, f in enumerate(flags) if f])
        if plain.rows:
            weights, _ = _exp_scaled(_take_rows(logits, plain.rows), plain.temperature)
            chosen = _two_level_race(weights, [generators[r] for r in plain.rows]).tolist()
            for row, token in zip(plain.rows, chosen, strict=True):
                token_ids[row] = token
        for kept in _find_kept(logits, filtered):
            if max(kept.counts) == 1:
                chosen = kept.ids[:, 0].tolist()
            else:
                noise = _exponential(kept.counts, [generators[r] for r in kept.rows],
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
        block = _take_rows(raw, rows)  # [R, V]
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
            values, ids = _top_candidates(block, most)
            values = values - norm
            for row, k, vals, toks in zip(rows, wanted, values.tolist(), ids.tolist(),
                                          strict=True):
                top[row] = list(zip(toks[:k], vals[:k], strict=True))
        return chosen_list, top

    @staticmethod
    def _check(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != batch.batch_size:
            raise ValueError(
                f"logits must be [B, V] with B = {batch.batch_size}, got {tuple(logits.shape)}"
            )
        return logits.float().contiguous()  # no copy when already float32 and contiguous


# --------------------------------------------------------------------------- rows


def _split_rows(batch: SamplingBatch) -> tuple[list[int], list[int]]:
    """(greedy rows, random rows)."""
    size = batch.batch_size
    if batch.all_greedy:
        return list(range(size)), []
    if batch.all_random:
        return [], list(range(size))
    temperature = batch.temperature.tolist()
    return ([i for i in range(size) if temperature[i] < GREEDY_TEMPERATURE_EPS],
            [i for i in range(size) if temperature[i] >= GREEDY_TEMPERATURE_EPS])


def _random_rows(batch: SamplingBatch, rows: list[int], vocab: int) -> _RandomRows:
    """The filter parameters of random `rows`, skipping tensors the flags rule out."""
    count = len(rows)
    temperature = batch.temperature.tolist()
    top_k = [vocab] * count
    top_p = [math.inf] * count
    log_min_p = [-math.inf] * count
    if not batch.no_top_k:
        all_k = batch.top_k.tolist()
        top_k = [all_k[r] if 0 < all_k[r] < vocab else vocab for r in rows]
    if not batch.no_top_p:
        all_p = batch.top_p.tolist()
        top_p = [all_p[r] if all_p[r] < 1.0 else math.inf for r in rows]
    if not batch.no_min_p:
        all_min_p = batch.min_p.tolist()
        log_min_p = [math.log(all_min_p[r]) if all_min_p[r] > 0.0 else -math.inf for r in rows]
    return _RandomRows(rows=list(rows), temperature=[temperature[r] for r in rows],
                       top_k=top_k, top_p=top_p, log_min_p=log_min_p)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` ``[len(rows), V]``; `x` itself (no copy) when `rows` is every row in order."""
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        return x
    return x.index_select(0, _index(rows, x.device))


# --------------------------------------------------------------------------- penalties


def _penalty_rows(batch: SamplingBatch) -> list[int]:
    active = (
        (batch.presence_penalty != 0.0)
        | (batch.frequency_penalty != 0.0)
        | (batch.repetition_penalty != 1.0)
    )
    return active.nonzero().squeeze(1).tolist()


def _apply_penalties(out: torch.Tensor, rows: list[int], batch: SamplingBatch) -> None:
    """Apply repetition, frequency and presence penalties to `rows` of `out` in place.

    Works on the flat positions ``row * V + token`` of the tokens that occurred, so the
    cost follows the number of prompt/output tokens, not ``P * V``.
    """
    device = out.device
    vocab = out.shape[1]
    flat = out.view(-1)
    rep = batch.repetition_penalty.tolist()

    outputs = _flat_positions([batch.output_token_ids[r] for r in rows], rows, vocab)
    rep_rows = [r for r in rows if rep[r] != 1.0]
    if rep_rows:
        # Repetition: every token seen in the prompt or the output, once each.
        prompts = _flat_positions([batch.prompt_token_ids[r] for r in rep_rows], rep_rows, vocab)
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


def _flat_positions(
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


# --------------------------------------------------------------------------- filters


def _find_kept(logits: torch.Tensor, params: _RandomRows) -> Iterator[_KeptSet]:
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
        weights, shift = _exp_scaled(_take_rows(logits, [rows[i] for i in needs_lse]),
                                     [params.temperature[i] for i in needs_lse])
        totals = (weights.sum(dim=-1).log_() + shift.squeeze(1)).tolist()
        for i, value in zip(needs_lse, totals, strict=True):
            lse[i] = value

    pending = list(range(len(rows)))  # positions into `rows`
    for width in [c for c in _CANDIDATE_LEVELS if c < vocab] + [vocab]:
        level = [i for i in pending
                 if width == vocab or params.top_k[i] <= width or params.top_k[i] == vocab]
        if not level:
            continue
        block = _take_rows(logits, [rows[i] for i in level])
        if width < vocab:
            values, ids = _top_candidates(block, width)
        else:
            values, ids = block.sort(dim=-1, descending=True)
        columns = torch.tensor(
            [[params.temperature[i], params.top_k[i], params.top_p[i], params.log_min_p[i],
              lse[i]] for i in level],
            dtype=torch.float32, device=device,
        )  # [G, 5]
        scaled = values / columns[:, 0:1]
        keep = _keep_prefix(
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
                pick = _index(done, device)
                ids, scaled, keep = ids[pick], scaled[pick], keep[pick]
            yield _canonical([rows[level[j]] for j in done], ids, scaled, keep,
                             [counts[j] for j in done], vocab)
        finished = {level[j] for j in done}
        pending = [i for i in pending if i not in finished]
        if not pending:
            break


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` ``[G]`` for ``[G, V]``, ties to the lowest id, done in two steps.

    Block maxima over blocks of 64 ids, then the first block holding the row maximum,
    then the first maximum inside it: the same answer as ``torch.argmax`` (which returns
    the first maximal index) at a fraction of its CPU cost.
    """
    size, vocab = x.shape
    block = _CANDIDATE_BLOCK
    if vocab % block or vocab < 8 * block:
        return x.argmax(dim=-1)
    blocks = x.view(size, vocab // block, block)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [G]
    inside = blocks[torch.arange(size, device=x.device), best].argmax(dim=-1)
    return best * block + inside


def _top_candidates(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest values of each row of `x` ``[G, V]``, descending, and their ids.

    Same values as ``x.topk(width)`` (ids may differ only among equal values), but for
    small widths it first keeps the `width` blocks of 64 ids with the largest maxima,
    which must hold the `width` largest values, so the exact topk runs on
    ``width * 64`` values instead of V.
    """
    size, vocab = x.shape
    block = _CANDIDATE_BLOCK
    if vocab % block or width * block * 4 > vocab:
        return x.topk(width, dim=-1)
    blocks = x.view(size, vocab // block, block)
    _, best = blocks.amax(dim=-1).topk(width, dim=-1)  # [G, width] block indices
    rows = torch.arange(size, device=x.device).unsqueeze(1)
    pool = blocks[rows, best].reshape(size, width * block)
    values, local = pool.topk(width, dim=-1)
    ids = best.gather(1, local // block) * block + local % block
    return values, ids


def _exp_scaled(
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


def _keep_prefix(
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


def _canonical(
    rows: list[int],
    ids: torch.Tensor,
    scaled: torch.Tensor,
    keep: torch.Tensor,
    counts: list[int],
    vocab: int,
) -> _KeptSet:
    """Reorder each row's kept candidates (a prefix of `keep`, ``[G, C]``) by token id.

    Token id order makes a seeded row's noise land on the same tokens however the
    candidate search ordered equal logits.
    """
    width = max(counts)
    if width == 1:
        return _KeptSet(rows=rows, ids=ids[:, :1], scaled=scaled[:, :1], counts=counts)
    kept_ids = torch.where(keep[:, :width], ids[:, :width], vocab)
    sorted_ids, order = kept_ids.sort(dim=-1)
    return _KeptSet(rows=rows, ids=sorted_ids, scaled=scaled[:, :width].gather(1, order),
                    counts=counts)


# --------------------------------------------------------------------------- noise


def _exponential(
    counts: list[int], generators: Sequence[torch.Generator | None], like: torch.Tensor
) -> torch.Tensor:
    """Exponential(1) noise shaped like `like` ``[G, W]``, strictly positive and finite.

    Row ``i`` has ``counts[i]`` real entries. A row with a generator draws exactly that
    many uniforms from it, or none when ``counts[i] == 1`` (nothing to choose), so its
    noise depends on nothing else in the batch; rows without one share a single draw
    from the global RNG. Entries past ``counts[i]`` are arbitrary positive values (the
    caller masks them). ``E = -log(U)`` is used because ``Tensor.exponential_`` is several
    times slower on CPU.
    """
    size, width = like.shape
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == size:
        uniform = torch.rand(size, width, device=like.device)
    else:
        uniform = torch.full((size, width), 0.5, device=like.device)
        if shared:
            widest = max(counts[i] for i in shared)
            draw = torch.rand(len(shared), widest, device=like.device)
            uniform[_index(shared, like.device), :widest] = draw
        for i, generator in enumerate(generators):
            if generator is not None and counts[i] > 1:
                uniform[i, : counts[i]].uniform_(generator=generator)
    # U = 0 would give E = inf; clamping gives a large finite E instead.
    return uniform.clamp_(min=torch.finfo(uniform.dtype).tiny).log_().neg_()


def _two_level_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Sample token i of each row with probability ``probs[i] / sum(probs)``; ``[G]``.

    `probs` is ``[G, V]`` of non-negative weights, each row with a positive sum.

    An exponential race run in two rounds so that only ``V / 256 + 256`` noise values per
    row are needed instead of ``V``: first a block of 256 consecutive ids wins with
    probability equal to its mass, then a token of that block wins with probability
    proportional to its own. The product is exactly ``probs``.
    """
    size, vocab = probs.shape
    num_blocks = -(-vocab // _RACE_BLOCK)
    pad = num_blocks * _RACE_BLOCK - vocab
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(size, num_blocks, _RACE_BLOCK)
    mass = blocks.sum(dim=-1)  # [G, num_blocks]
    # One draw per row serves both rounds: the first num_blocks values, then the rest.
    width = num_blocks + _RACE_BLOCK
    noise = _exponential([width] * size, generators, mass.new_empty(size, width))
    block = (mass / noise[:, :num_blocks]).argmax(dim=-1)
    inside = blocks[torch.arange(size, device=probs.device), block]  # [G, block]
    return block * _RACE_BLOCK + (inside / noise[:, num_blocks:]).argmax(dim=-1)
