"""What the sampler knows of a batch: each row's parameters as tensors and lists, its
generator, its prompt and output tokens; and which rows sample greedily or at random."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenyard.engine.to_device import to_device
from tokenyard.wire.sampling_params import SamplingParams

#: The float parameters, in the order `from_params` stacks them.
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")

# Temperatures below this are treated as greedy (as vLLM does), to avoid dividing by ~0.
GREEDY_TEMPERATURE_EPS = 1e-5


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
    #: Constrained decoding: an int32 ``[B, ceil(V/32)]`` bitmask of the allowed tokens
    #: (bit ``t % 32`` of word ``t // 32``) and the rows it applies to; None: no row has one.
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] = field(default_factory=list)
    #: Per-row parameters by field name as Python lists, kept by `from_params` so that
    #: branching on them never reads the device (see `values`).
    host_values: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    def values(self, name: str) -> list[Any]:
        """The per-row parameter `name` (a tensor field's name) as a Python list."""
        kept = self.host_values.get(name)
        return kept if kept is not None else getattr(self, name).tolist()

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

        temperature = [p.temperature for p in params]
        random_rows = [p for p, t in zip(params, temperature, strict=True)
                       if t >= GREEDY_TEMPERATURE_EPS]
        # One tensor of the float parameters, one copy to the device; rows are views.
        floats = torch.tensor([[getattr(p, name) for p in params] for name in _FLOATS],
                              dtype=torch.float32).reshape(len(_FLOATS), size)
        top_k = [p.top_k for p in params]
        # The values as the tensors hold them (float32), for `values`.
        kept: dict[str, list[Any]] = dict(zip(_FLOATS, floats.tolist(), strict=True))
        kept["top_k"] = top_k
        on_device = to_device(floats, device)
        return cls(
            temperature=on_device[0],
            top_p=on_device[1],
            top_k=to_device(torch.tensor(top_k, dtype=torch.int64), device),
            min_p=on_device[2],
            presence_penalty=on_device[3],
            frequency_penalty=on_device[4],
            repetition_penalty=on_device[5],
            host_values=kept,
            logit_bias=[p.logit_bias or None for p in params],
            generators=gens,
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            num_logprobs=[p.logprobs for p in params],
            all_greedy=not random_rows,
            all_random=len(random_rows) == size,
            no_penalties=not any(p.has_penalties for p in params),
            no_top_k=all(p.top_k <= 0 for p in random_rows),
            no_top_p=all(p.top_p >= 1.0 for p in random_rows),
            no_min_p=all(p.min_p <= 0.0 for p in random_rows),
        )


@dataclass
class RandomRows:
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

    def subset(self, positions: list[int]) -> RandomRows:
        return RandomRows(
            rows=[self.rows[i] for i in positions],
            temperature=[self.temperature[i] for i in positions],
            top_k=[self.top_k[i] for i in positions],
            top_p=[self.top_p[i] for i in positions],
            log_min_p=[self.log_min_p[i] for i in positions],
        )


def split_rows(batch: SamplingBatch) -> tuple[list[int], list[int]]:
    """(greedy rows, random rows)."""
    size = batch.batch_size
    if batch.all_greedy:
        return list(range(size)), []
    if batch.all_random:
        return [], list(range(size))
    temperature = batch.values("temperature")
    return ([i for i in range(size) if temperature[i] < GREEDY_TEMPERATURE_EPS],
            [i for i in range(size) if temperature[i] >= GREEDY_TEMPERATURE_EPS])


def random_rows(batch: SamplingBatch, rows: list[int], vocab: int) -> RandomRows:
    """The filter parameters of random `rows`, skipping tensors the flags rule out."""
    count = len(rows)
    temperature = batch.values("temperature")
    top_k = [vocab] * count
    top_p = [math.inf] * count
    log_min_p = [-math.inf] * count
    if not batch.no_top_k:
        all_k = batch.values("top_k")
        top_k = [all_k[r] if 0 < all_k[r] < vocab else vocab for r in rows]
    if not batch.no_top_p:
        all_p = batch.values("top_p")
        top_p = [all_p[r] if all_p[r] < 1.0 else math.inf for r in rows]
    if not batch.no_min_p:
        all_min_p = batch.values("min_p")
        log_min_p = [math.log(all_min_p[r]) if all_min_p[r] > 0.0 else -math.inf for r in rows]
    return RandomRows(rows=list(rows), temperature=[temperature[r] for r in rows],
                       top_k=top_k, top_p=top_p, log_min_p=log_min_p)


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` ``[len(rows), V]``; `x` itself (no copy) when `rows` is every row in order."""
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        return x
    return x.index_select(0, index_tensor(rows, x.device))
