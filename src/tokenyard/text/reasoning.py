"""A reasoning model's thinking, split from its answer as the output streams.

Qwen3 (and QwQ, DeepSeek-R1 and the other `<think>` models) write
``<think>…reasoning…</think>answer``. Some chat templates open the block in the prompt
already (the reply then starts inside it, with only ``</think>`` to come): `inside`
says so. `ReasoningParser.feed` returns the (reasoning, content) text of each piece,
holding back only what could be the start of a tag; `split_reasoning` does a whole text.
`REASONING_PARSERS` names them; `detect_reasoning_parser` picks one from a chat template.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenyard import config
from tokenyard.text.tool_formats import held_prefix

#: Parser names a deployment can pick (vLLM's --reasoning-parser spelling;
#: config.REASONING_PARSERS) -> its tags.
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    name: ("<think>", "</think>") for name in config.REASONING_PARSERS}


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits one reply into reasoning and content.

    Before any text: a reply that opens with the start tag (leading whitespace allowed)
    is reasoning until the end tag; one that does not is content, unless `inside` (the
    prompt opened the block). Tags never reach either side; one newline or space right
    after the end tag is dropped (the templates put one there).
    """

    def __init__(self, start: str, end: str, inside: bool = False) -> None:
        self.start, self.end = start, end
        self._state = "reasoning" if inside else "undecided"
        self._buf = ""
        self._after_end = False

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        out = ReasoningDelta()
        if self._state == "undecided":
            head = self._buf.lstrip()
            if head.startswith(self.start):
                self._buf = head[len(self.start):]
                self._state = "reasoning"
            elif not head or self.start.startswith(head):
                return out
            else:
                self._state = "content"
        if self._state == "reasoning":
            at = self._buf.find(self.end)
            if at < 0:
                keep = held_prefix(self._buf, self.end)
                out.reasoning = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            out.reasoning = self._buf[:at]
            self._buf = self._buf[at + len(self.end):]
            self._state, self._after_end = "content", True
        if self._after_end:
            if not self._buf:
                return out
            if self._buf[0] in "\n ":
                self._buf = self._buf[1:]
            self._after_end = False
        out.content, self._buf = self._buf, ""
        return out

    def finish(self) -> ReasoningDelta:
        """What was held back: a reply cut inside its thinking keeps it as reasoning."""
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content=rest)


def reasoning_parser(name: str | None, inside: bool = False) -> ReasoningParser | None:
    """The parser of `name` (None: no reasoning); ValueError for an unknown name."""
    if name is None or name == "none":
        return None
    tags = REASONING_PARSERS.get(name)
    if tags is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return ReasoningParser(*tags, inside=inside)


def split_reasoning(text: str, parser: ReasoningParser) -> tuple[str, str]:
    """(reasoning, content) of a finished reply."""
    first, last = parser.feed(text), parser.finish()
    return first.reasoning + last.reasoning, first.content + last.content


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """"qwen3" for a template that writes `<think>` blocks, else None."""
    return "qwen3" if chat_template and "<think>" in chat_template else None


def prompt_opens_reasoning(prompt: str, name: str | None) -> bool:
    # The end of the rendered prompt is enough (callers decode its last few tokens).
    """Whether the rendered prompt ends with an open reasoning block (the reply then
    starts inside it), as QwQ's and Qwen3-Thinking-2507's templates write it."""
    tags = REASONING_PARSERS.get(name or "")
    return tags is not None and prompt.rstrip().endswith(tags[0])


def count_reasoning_tokens(token_ids: Sequence[int], token_bytes: Callable[[int], bytes],
                           name: str, inside: bool = False) -> int:
    """How many of a finished reply's generated tokens are reasoning."""
    counter = ReasoningCounter(token_bytes, name, inside)
    counter.push(token_ids, finished=True)
    assert counter.count is not None
    return counter.count


class ReasoningCounter:
    """The reasoning tokens of one reply, counted from its token ids as they stream:
    those up to and including the one that closes the block; all of them when it never
    closes; none when the reply opens no block. `count` is None until that is known."""

    def __init__(self, token_bytes: Callable[[int], bytes], name: str,
                 inside: bool = False) -> None:
        self.token_bytes = token_bytes
        self.start, self.end = (tag.encode() for tag in REASONING_PARSERS[name])
        self.count: int | None = None
        self._tokens = 0
        self._head = b""  # the reply's first bytes, until it shows whether a block opens
        self._opened = inside  # the prompt opened the block
        self._tail = b""  # the last bytes, where the end tag may be completing

    def push(self, token_ids: Sequence[int], finished: bool) -> None:
        for token_id in token_ids:
            if self.count is not None:
                return
            piece = self.token_bytes(token_id)
            self._tokens += 1
            if not self._opened:
                self._head += piece
                head = self._head.lstrip()
                if head.startswith(self.start):
                    self._opened = True
                elif head and not self.start.startswith(head):
                    self.count = 0
                    return
            self._tail = (self._tail + piece)[-(len(piece) + len(self.end)):]
            if self._opened and self.end in self._tail:
                self.count = self._tokens
        if finished and self.count is None:
            self.count = self._tokens if self._opened else 0


class ReasoningStream:
    """One reply's reasoning as it streams: its text split (`ReasoningParser`) and its
    tokens counted (`ReasoningCounter`) together."""

    def __init__(self, token_bytes: Callable[[int], bytes], name: str, inside: bool) -> None:
        self._split = ReasoningParser(*REASONING_PARSERS[name], inside=inside)
        self._counter = ReasoningCounter(token_bytes, name, inside)

    def push(self, text: str, token_ids: Sequence[int], finished: bool) -> ReasoningDelta:
        """The reasoning and the answer in the next piece (all that was held back when
        `finished`)."""
        self._counter.push(token_ids, finished)
        out = self._split.feed(text)
        if finished:
            last = self._split.finish()
            out = ReasoningDelta(out.reasoning + last.reasoning, out.content + last.content)
        return out

    @property
    def tokens(self) -> int:
        """Reasoning tokens so far (final once the block closed or the reply ended)."""
        return self._counter.count or 0

    @property
    def settled(self) -> int | None:
        """The reply's reasoning tokens once known (the block closed, none opened, or
        the reply ended); None while the reply may still be reasoning."""
        return self._counter.count


def split_completion(text: str, token_ids: Sequence[int], token_bytes: Callable[[int], bytes],
                     reasoning: tuple[str, bool]) -> tuple[str, str, int]:
    """(reasoning, answer, reasoning tokens) of a finished reply; `reasoning` is the
    parser's name and whether the prompt opened the block."""
    stream = ReasoningStream(token_bytes, *reasoning)
    out = stream.push(text, token_ids, finished=True)
    return out.reasoning, out.content, stream.tokens
