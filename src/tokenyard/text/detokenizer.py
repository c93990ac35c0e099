"""Streaming token ids back into text without breaking characters.

A byte-level token can hold part of a UTF-8 character (an emoji is often three tokens), so decoding
each token alone would stream "\ufffd" garbage. Decoding the whole sequence on every step would be
correct but quadratic. `IncrementalDetokenizer` decodes a short window instead: the tokens since the
last emitted text plus the chunk before them (`prefix`) as context, and emits the difference.
"""

from __future__ import annotations

from tokenyard.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context: decoders such as sentencepiece's drop a leading space
# on the first token they see, so the first generated token must not be first in the window.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    `prompt_ids` (optional) are the prompt's ids; only their tail is used, as decoding context.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        """Start a stream; nothing of the prompt is ever emitted."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        # Window bounds into self._ids: [prefix, read) was emitted already and serves as context;
        # [read, end) is new. `_sent` counts characters of the new part already emitted while its
        # last character was still incomplete.
        self._prefix = 0
        self._read = len(context)
        self._sent = 0
        self._pieces: list[str] = []
        self._text_cache: str | None = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def push(self, new_ids: list[int]) -> str:
        """Add generated ids and return the text they complete (possibly "").

        A character whose bytes are not all here yet is held back until they arrive.
        """
        self._ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character comes out as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        context = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        new = window[len(context) :]
        # An incomplete UTF-8 sequence at the end decodes to exactly one U+FFFD; hold that one back
        # (an earlier U+FFFD is followed by more text, so it is real and is emitted).
        if not final and new.endswith(_REPLACEMENT):
            stable = new[:-1]
            delta = stable[self._sent :]
            self._sent = max(self._sent, len(stable))
        else:
            delta = new[self._sent :]
            # Everything decoded is final: the emitted chunk becomes the next window's context.
            self._prefix, self._read, self._sent = self._read, len(self._ids), 0
            # Ids before the window are never looked at again; dropping them keeps memory and
            # slicing proportional to the window, not to the whole generation.
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        if delta:
            self._pieces.append(delta)
            self._text_cache = None
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
