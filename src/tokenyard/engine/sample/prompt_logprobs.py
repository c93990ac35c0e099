"""Prompt logprobs (vLLM's `prompt_logprobs`, the legacy completions' `echo` with
`logprobs`): the hidden state of prompt position p, projected to logits, scores prompt
token p + 1. A step scores the prefill rows it computes; a long prompt's chunks are scored
step by step, and the engine joins them (engine/core.py).

Logits are taken a slice of rows at a time, so a long prefill never holds a
[prompt, vocab] matrix: only [ROWS_PER_SLICE, vocab].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenyard.engine.sample.filters import top_candidates
from tokenyard.wire.outputs import TokenLogprobs

#: Rows projected to logits at once (a float32 [256, 150k] slice is about 150 MB).
ROWS_PER_SLICE = 256


@dataclass(frozen=True)
class PromptSpan:
    """Rows of one request's prefill chunk to score: hidden rows `row` … and prompt
    positions `first` …, each scored against the token after it, in `targets`."""

    request_id: str
    row: int
    first: int
    targets: list[int]
    k: int  # top alternatives per position


def prompt_span(request_id: str, prompt: list[int], k: int | None, row: int, start: int,
                num_rows: int, num_scored: int) -> PromptSpan | None:
    """The span of a chunk computing positions `start` … `start + num_rows - 1` (hidden rows
    `row` …) that still needs scoring: from `num_scored` (positions already scored) to the
    last prompt position with a next token. None when nothing in it needs scoring."""
    if k is None:
        return None
    first = max(start, num_scored)
    end = min(start + num_rows, len(prompt) - 1)
    if first >= end:
        return None
    return PromptSpan(request_id, row + first - start, first, prompt[first + 1:end + 1], k)


def score_prompt_rows(
    hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
    spans: list[PromptSpan],
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """Per request: (first position scored, each position's target logprob and top k),
    from the raw logits (no temperature, penalty or bias), as the sampler's logprobs."""
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    for span in spans:
        scored: list[TokenLogprobs] = []
        for lo in range(0, len(span.targets), ROWS_PER_SLICE):
            targets = span.targets[lo:lo + ROWS_PER_SLICE]
            rows = hidden[span.row + lo:span.row + lo + len(targets)]
            logits = compute_logits(rows).float()
            norm = torch.logsumexp(logits, dim=-1, keepdim=True)
            index = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)
            chosen = (logits.gather(1, index) - norm).squeeze(1).tolist()
            tops: list[list[tuple[int, float]]] = [[] for _ in targets]
            if span.k > 0:
                values, ids = top_candidates(logits, min(span.k, logits.shape[1]))
                tops = [list(zip(t, v, strict=True))
                        for t, v in zip(ids.tolist(), (values - norm).tolist(), strict=True)]
            scored.extend(TokenLogprobs(c, t) for c, t in zip(chosen, tops, strict=True))
        out[span.request_id] = (span.first, scored)
    return out


def join_scores(have: list[TokenLogprobs], first: int, scored: list[TokenLogprobs]) -> None:
    """Append a step's scores (`scored`, from prompt position `first`) to those a request
    has (positions 0 … len(have) - 1); positions it has already (a recompute after
    preemption) are kept as they are."""
    if first <= len(have):
        have.extend(scored[len(have) - first:])
