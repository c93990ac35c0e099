"""Verifying drafts: which of them the target keeps, with its own distribution intact.

The target computes the draft positions in one step and samples a token at each of them
with the request's own sampler (temperature, top-k/p, min-p, bias, penalties, seed), as
if every draft before it had been accepted. The reply keeps drafts while the target
sampled the same token, and then the target's token where the two first differ (or, all
drafts kept, the token it sampled after the last one): 1 to k + 1 tokens a step.

This is rejection sampling for drafts that are one token for certain (n-gram lookup: the
draft distribution q is one-hot at d). Speculative sampling keeps d with probability
min(1, p(d) / q(d)) = p(d) and, on rejection, samples from max(0, p - q) normalised: p
without d, renormalised. A token t sampled from p is d with probability p(d), and given
t != d it is distributed as p without d, renormalised: one sample does both. Greedy rows
sample the argmax, so greedy output is token for token what decoding without drafts
gives. A draft model's drafts are its argmax (draft.py): q is one-hot there too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a step adds: `sampled` holds the target's token at each draft position
    and one after the last (len(drafts) + 1 of them)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} samples, "
                         f"not {len(sampled)}")
    out: list[int] = []
    for draft, chosen in zip(drafts, sampled, strict=False):
        out.append(chosen)
        if chosen != draft:
            return out
    out.append(sampled[-1])
    return out


def verify_rows(requests: Sequence[Any], tokens: Sequence[int],
                drafts: dict[str, list[int]]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """A step's sampled rows, per request: its first token, and for the requests that
    verified drafts (whose rows are consecutive) the tokens they keep."""
    sampled: dict[str, int] = {}
    accepted: dict[str, list[int]] = {}
    row = 0
    while row < len(requests):
        request_id = requests[row].request_id
        mine = drafts.get(request_id)
        if mine is None:
            sampled[request_id] = tokens[row]
            row += 1
            continue
        kept = accepted_tokens(mine, tokens[row:row + len(mine) + 1])
        sampled[request_id], accepted[request_id] = kept[0], kept
        row += len(mine) + 1
    return sampled, accepted
