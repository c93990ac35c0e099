"""The legacy completions' fields that are more than a sampling parameter: `best_of`,
`suffix` and `echo` with `logprobs` or `max_tokens` 0.

- `best_of` > `n`: best_of completions are generated (server side, as OpenAI's legacy
  API and vLLM did) and the n with the highest cumulative logprob are returned, best
  first; usage counts every generated token. The engine is asked for the chosen
  tokens' logprobs to rank them (`logprobs: 0` when the client asked for none, and then
  they are left out of the answer). Not with `stream` (OpenAI refuses it too: the
  best are known only at the end).
- `suffix`: fill-in-the-middle needs a model trained for it with its own prompt format;
  no model served here has one, so a non-empty suffix is refused naming it and saying
  why (vLLM refuses it the same way), rather than silently ignored.
- `echo` with `logprobs`: the engine scores the prompt (`prompt_logprobs`, computed over
  the whole prompt, not read from the prefix cache) and the choice's logprobs cover the
  prompt's tokens, then the generated ones (`legacy_logprobs.py`). With `max_tokens` 0
  the answer is the prompt alone, scored (what evaluation harnesses ask for a
  log-likelihood): the engine scores the prompt and generates nothing (finish_reason
  "length", no completion tokens; without `logprobs` the scores are computed and left
  out). `max_tokens` 0 without `echo` stays refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tokenyard.api.openai.schemas import MAX_N, CompletionRequest
from tokenyard.errors import INVALID_VALUE, invalid_request, unsupported
from tokenyard.wire.outputs import Completion


@dataclass(frozen=True)
class BestOf:
    """Keep the `n` best of each prompt's completions; `logprobs`: the client asked for
    them (else they were computed only to rank)."""

    n: int
    logprobs: bool


def best_of(req: CompletionRequest, n: int) -> BestOf | None:
    """The choice to make after generation when `best_of` > `n` (None: no choice)."""
    if req.best_of is None or req.best_of <= n:
        return None
    return BestOf(n, req.logprobs is not None)


def engine_n(req: CompletionRequest, n: int, num_prompts: int) -> int:
    """How many completions of each prompt to generate: `best_of` when it is set (and
    valid: at least n, not streamed, at most MAX_N in all), else n."""
    if req.best_of is None or req.best_of == n:
        return n
    if req.best_of < n:
        raise invalid_request("'best_of' must be greater than or equal to 'n'.",
                              param="best_of", code=INVALID_VALUE)
    if req.stream:
        raise invalid_request("'best_of' greater than 'n' cannot be used with 'stream': the "
                              "best completions are known only once all have finished.",
                              param="best_of", code=INVALID_VALUE)
    if req.best_of * num_prompts > MAX_N:
        raise invalid_request(f"'best_of' times the number of prompts must be at most {MAX_N}.",
                              param="best_of", code=INVALID_VALUE)
    return req.best_of


def engine_logprobs(req: CompletionRequest, n: int) -> int | None:
    """The logprobs to ask the engine for: the client's, or the chosen tokens' alone
    (0) when `best_of` must rank completions by them."""
    if req.logprobs is None and best_of(req, n) is not None:
        return 0
    return req.logprobs


def cumulative_logprob(completion: Completion) -> float:
    """The sum of a completion's chosen tokens' logprobs (how likely the model found it)."""
    return sum(lp.logprob for lp in completion.logprobs or ())


def choose(completions: Sequence[Sequence[Completion]], best: BestOf
           ) -> list[list[Completion]]:
    """Each prompt's `best.n` completions with the highest cumulative logprob, best first
    and numbered 0 … n-1, without logprobs unless the client asked for them."""
    chosen = []
    for per_prompt in completions:
        ranked = sorted(per_prompt, key=lambda c: (-cumulative_logprob(c), c.index))
        chosen.append([replace(c, index=j, logprobs=c.logprobs if best.logprobs else None)
                       for j, c in enumerate(ranked[:best.n])])
    return chosen


def echo_only(req: CompletionRequest) -> bool:
    """`echo` with `max_tokens` 0: the answer is the prompt alone."""
    return bool(req.echo) and req.max_tokens == 0


def refuse_suffix(req: CompletionRequest, model: str) -> None:
    """A 400 naming `suffix` when one is given: the model cannot fill in the middle."""
    if req.suffix:
        raise unsupported(
            "suffix", f"The model '{model}' does not support 'suffix': inserting text "
            "before a suffix (fill-in-the-middle) needs a model trained with a "
            "fill-in-the-middle prompt format, and this one has none.")
