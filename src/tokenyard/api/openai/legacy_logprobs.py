"""The legacy completions' `logprobs` object (parallel lists `tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), generated tokens alone or, with `echo`, the prompt's
tokens first.

With `echo` and `logprobs` the prompt is scored (the engine's prompt logprobs): its first
token has no logprob (null, and null top alternatives), each later one its logprob given
the tokens before it; then come the generated tokens. `text_offset` counts characters of
the choice's text: the echoed prompt's tokens from 0, the generated ones from the end of
the echoed text.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable, Sequence

from tokenyard.api.openai.schemas import CompletionLogprobs
from tokenyard.wire.outputs import Completion, Logprob, PromptLogprobs

#: Raw bytes of a token id (`Tokenizer.id_to_token_bytes`), for logprobs' `token`/`bytes`.
TokenBytes = Callable[[int], bytes]

#: The logprob reported for a token the model gives no finite logprob (as OpenAI does).
MIN_LOGPROB = -9999.0


def token_string(raw: bytes) -> str:
    """A token's text for logprobs; a partial UTF-8 sequence is spelled "bytes:\\xe2\\x80"."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class OffsetCounter:
    """Character offsets of successive tokens' text (partial UTF-8 sequences count once)."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset where this token starts; moves past it."""
        at = self.offset
        self.offset += len(self._decoder.decode(raw))
        return at


def completion_logprobs_at(
    entries: Sequence[Logprob], token_bytes: TokenBytes, offsets: OffsetCounter,
    out: CompletionLogprobs | None = None,
) -> CompletionLogprobs:
    """`entries` appended to `out` (None: a new object), offsets taken from `offsets`."""
    out = CompletionLogprobs() if out is None else out
    for entry in entries:
        raw = token_bytes(entry.token_id)
        out.tokens.append(token_string(raw))
        out.token_logprobs.append(finite(entry.logprob))
        out.top_logprobs.append(
            {token_string(token_bytes(t)): finite(lp) for t, lp in entry.top}
        )
        out.text_offset.append(offsets.advance(raw))
    return out


def prompt_logprobs(prompt: PromptLogprobs, token_bytes: TokenBytes) -> CompletionLogprobs:
    """The echoed prompt's part: its first token without a logprob, then the scored ones,
    offsets from 0."""
    offsets = OffsetCounter()
    out = CompletionLogprobs()
    if prompt.token_ids:
        raw = token_bytes(prompt.token_ids[0])
        out.tokens.append(token_string(raw))
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(offsets.advance(raw))
    return completion_logprobs_at(prompt.entries, token_bytes, offsets, out)


def choice_logprobs(completion: Completion, token_bytes: TokenBytes,
                    echo: str | None) -> CompletionLogprobs | None:
    """A finished choice's `logprobs` (None when none were computed). With `echo` (the
    echoed prompt's text) and the prompt scored, the prompt's tokens come first."""
    scored = completion.prompt_logprobs if echo is not None else None
    if completion.logprobs is None and scored is None:
        return None
    out = prompt_logprobs(scored, token_bytes) if scored is not None else None
    return completion_logprobs_at(completion.logprobs or (), token_bytes,
                                  OffsetCounter(len(echo or "")), out)
