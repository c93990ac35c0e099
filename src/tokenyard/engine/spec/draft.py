"""Draft-model speculation: a smaller model of the target's vocabulary proposes the drafts.

The design follows vLLM's `draft_model` method. The draft runs in the engine's process,
over its own paged KV pool (as many blocks as the target's, of the same size, no prefix
caching) with its own block tables and runner (`ModelRunner.greedy`): the target's prefix
hits, preemptions and rejected positions never leave the draft's KV stale, because only
the draft writes it. Each step, at planning time, for all the requests that speculate:

- one forward catches each of them up on the tokens its draft KV lacks (the whole context
  at first, then what the last step added: the accepted drafts and the target's token)
  and gives the first draft at each request's last row;
- then one forward per further draft position, one row per request, feeds draft i and
  gives draft i + 1: k forwards a step for the whole batch, not k per request.

Rollback is a count: a request's draft KV is valid for its first `computed` tokens. After
a step, the request's length when it drafted plus the drafts the target kept (at most the
positions the draft wrote) is valid; the rejected positions are written again once their
right tokens are known. A request that finishes, is aborted or preempted gives its draft
blocks back (`release`).

Drafts are the draft model's argmax: the draft distribution q is one-hot, so verify.py's
rule (keep drafts while the target samples them) is exact rejection sampling and sampled
replies keep the target's distribution, with greedy ones token for token what decoding
alone gives. vLLM's general rule (keep d with min(1, p(d) / q(d)), else sample from
max(0, p - q) renormalised) lets the draft sample; it pays when q is close to p at a high
temperature, but it needs q's whole distribution at every draft position carried into
verification and a second, residual sampling pass there, and it gains nothing for greedy
rows. Argmax drafts keep verification one rule for n-gram and draft-model drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenyard.engine.kv_cache import KVCacheManager
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.request import Request
from tokenyard.engine.step_plan import SchedulerOutput
from tokenyard.text.tokenizer import Tokenizer

#: A draft forward: the argmax token at each sampled row of a step, by request id, the
#: placeholder rows (positions past a request's tokens) taking the given tokens.
Greedy = Callable[[SchedulerOutput, dict[str, int]], dict[str, int]]


@dataclass(frozen=True)
class DraftConfig:
    """vLLM's `draft_model` method: the draft's `model` and `num_speculative_tokens`."""

    model: str
    k: int = 4  # drafts proposed per step

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("speculative_config: a draft model needs its 'model'")
        if self.k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, not {self.k}")


@dataclass
class DraftModel:
    """The loaded draft: its model (a families.CausalLM) and configuration."""

    model: Any
    config: ModelConfig


def check_same_vocabulary(target: ModelConfig, target_tokenizer: Tokenizer,
                          draft: ModelConfig, draft_tokenizer: Tokenizer) -> None:
    """ValueError unless the draft's token ids mean what the target's do."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft.name!r} has a vocabulary of {draft.vocab_size} tokens, "
            f"the target {target.name!r} one of {target.vocab_size}: a draft model must "
            "share the target's tokenizer")
    size = target_tokenizer.vocab_size
    if (draft_tokenizer.vocab_size != size
            or draft_tokenizer.convert_ids_to_tokens(range(size))
            != target_tokenizer.convert_ids_to_tokens(range(size))):
        raise ValueError(
            f"draft model {draft.name!r}: its tokenizer is not the target's (the same "
            "token ids would spell other text); a draft model must share the target's "
            "tokenizer")


@dataclass
class _Seq:
    computed: int = 0  # tokens whose draft KV is valid
    base: int = 0  # the request's length when it last drafted
    written: int = 0  # positions whose draft KV that drafting wrote


@dataclass
class DraftProposer:
    """Proposes the drafts of a step's speculating requests with the draft model."""

    greedy: Greedy
    kv: KVCacheManager  # the draft's own pool
    max_len: int  # positions the draft may compute (its context window, the engine's)
    _seqs: dict[str, _Seq] = field(default_factory=dict)
    _freed: list[str] = field(default_factory=list)  # for the draft runner's next step

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to k argmax drafts per (request, k); a request the draft's pool or context
        cannot hold this step gets none."""
        rows: list[tuple[Request, int, int]] = []  # request, first position run, k
        for request, k in wanted:
            length = request.num_tokens
            k = min(k, self.max_len - length + 1)  # the last draft fed sits at length+k-2
            seq = self._seqs.setdefault(request.request_id, _Seq())
            start = min(seq.computed, length - 1)  # the last token is run for its logits
            if k > 0 and self.kv.allocate_slots(request, length + k - 1 - start,
                                                computed=start):
                rows.append((request, start, k))
        if not rows:
            return {}
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _, _ in rows}
        step = [(r, start, r.num_tokens - start) for r, start, _ in rows]
        for i in range(max(k for _, _, k in rows)):
            if i:
                step = [(r, r.num_tokens - 1 + i, 1) for r, _, k in rows if k > i]
            fills = {r.request_id: drafts[r.request_id][-1] for r, _, _ in step if i}
            for request_id, token in self._forward(step, fills).items():
                drafts[request_id].append(token)
        for request, _, k in rows:
            seq = self._seqs[request.request_id]
            seq.base = seq.computed = request.num_tokens
            seq.written = request.num_tokens + k - 1
        return drafts

    def settle(self, request_id: str, kept: int) -> None:
        """`kept` drafts of the request's last proposal were accepted: their draft KV
        stays valid (the draft wrote it for all but the last of its k drafts)."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            seq.computed = min(seq.base + kept, seq.written)

    def release(self, request: Request) -> None:
        """The request finished or was preempted: its draft blocks go back to the pool."""
        if self._seqs.pop(request.request_id, None) is not None:
            self.kv.free(request)
            self._freed.append(request.request_id)

    @property
    def num_requests(self) -> int:
        """Requests holding draft state (and blocks)."""
        return len(self._seqs)

    def _forward(self, rows: list[tuple[Request, int, int]],
                 fills: dict[str, int]) -> dict[str, int]:
        """One draft forward over (request, first position, tokens) rows, each sampled
        at its last position."""
        step = SchedulerOutput(scheduled=[(r, n) for r, _, n in rows],
                               starts={r.request_id: start for r, start, _ in rows},
                               sampling={r.request_id for r, _, _ in rows})
        step.freed, self._freed = self._freed, []
        return self.greedy(step, fills)
