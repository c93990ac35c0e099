"""What the requests of a load run ask, fixed by a seed: `synthetic`, `multiturn`, `long`.

Prompts are built from `WORDS`, common English words that are each one token (with their
leading space) in GPT-2-style BPE vocabularies such as SmolLM2's, so a prompt of n words is
close to n tokens; the chat template adds its own few tokens around each message. Each
workload is an endless iterator: the run decides how many requests it takes.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

#: One token each in SmolLM2's vocabulary (checked by the tests), most of them in most BPE
#: vocabularies.
_WORD_TEXT = """
the of and to in is that for it with as was on be at by this had not are but from or have
an they which one you were her all she there would their we him been has when who will
more no if out so said what up its about into than them can only other new some could time
these two may then do first any my now such like our over man me even most made after also
did many before must through back years where much your way well down should because each
just those people
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

LEN_DISTS = ("fixed", "uniform", "normal")
WORKLOADS = ("synthetic", "multiturn", "long")


@dataclass(frozen=True)
class LengthDist:
    """A length in tokens: `mean`, drawn `fixed`, `uniform` in mean·(1 ± spread), or
    `normal` with standard deviation mean·spread; never below 1."""

    mean: int
    kind: str = "fixed"
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"a length must be at least 1, got {self.mean}")
        if self.kind not in LEN_DISTS:
            raise ValueError(f"length distribution must be one of {LEN_DISTS}, got {self.kind}")
        if self.spread < 0:
            raise ValueError(f"spread must be >= 0, got {self.spread}")

    def sample(self, rng: random.Random) -> int:
        """One length drawn from the distribution."""
        if self.kind == "uniform":
            lo = max(1, round(self.mean * (1.0 - self.spread)))
            return rng.randint(lo, max(lo, round(self.mean * (1.0 + self.spread))))
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.mean, self.mean * self.spread)))
        return self.mean


@dataclass(frozen=True)
class RequestSpec:
    """One request: chat turns (the last one the user's), the output length asked for, and
    the prompt length aimed at (in words, about tokens)."""

    messages: list[dict[str, str]]
    max_tokens: int
    input_len: int
    #: Multiturn: which conversation and turn this is (None / 0 otherwise).
    conversation: int | None = None
    turn: int = 0

    def prompt_text(self) -> str:
        """The turns as one plain-text prompt, for the completions API."""
        if len(self.messages) == 1:
            return self.messages[0]["content"]
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in self.messages]
        return "\n".join([*lines, "Assistant:"])


def words(rng: random.Random, n: int) -> str:
    """n words drawn from `WORDS` (about n tokens)."""
    return " ".join(rng.choices(WORDS, k=n))


def synthetic(
    input_len: LengthDist, output_len: LengthDist, seed: int = 0
) -> Iterator[RequestSpec]:
    """Single-turn requests of independent random words (no shared prefixes beyond the
    chat template's)."""
    rng = random.Random(seed)
    while True:
        n = input_len.sample(rng)
        yield RequestSpec([{"role": "user", "content": words(rng, n)}], output_len.sample(rng), n)


def multiturn(
    input_len: LengthDist,
    output_len: LengthDist,
    seed: int = 0,
    turns: int = 4,
    conversations: int = 4,
) -> Iterator[RequestSpec]:
    """Conversations of `turns` requests, each resending every earlier turn plus a new user
    message, so each prompt extends the previous turn's prompt (what a prefix cache reuses).

    `conversations` are open at once and take turns round-robin; one that ends is replaced
    by a new one. The assistant turns are fixed text of the output length asked for (not
    the server's replies), so the workload is the same whatever the server answers.
    """
    if turns < 1 or conversations < 1:
        raise ValueError("turns and conversations must be at least 1")
    rng = random.Random(seed)
    numbers = itertools.count()
    open_: list[tuple[int, list[dict[str, str]], int]] = []  # (id, history, turn)
    for _ in range(conversations):
        open_.append((next(numbers), [], 0))
    slot = 0
    while True:
        conv, history, turn = open_[slot]
        n = input_len.sample(rng)
        messages = [*history, {"role": "user", "content": words(rng, n)}]
        max_tokens = output_len.sample(rng)
        yield RequestSpec(messages, max_tokens, n, conversation=conv, turn=turn)
        reply = {"role": "assistant", "content": words(rng, max_tokens)}
        if turn + 1 < turns:
            open_[slot] = (conv, [*messages, reply], turn + 1)
        else:
            open_[slot] = (next(numbers), [], 0)
        slot = (slot + 1) % conversations


def make_workload(
    name: str,
    input_len: LengthDist,
    output_len: LengthDist,
    seed: int = 0,
    turns: int = 4,
    conversations: int = 4,
) -> Iterator[RequestSpec]:
    """The workload called `name`. `long` is `synthetic` with the long input lengths the
    caller passes (see `default_lengths`)."""
    if name == "multiturn":
        return multiturn(input_len, output_len, seed, turns, conversations)
    if name in ("synthetic", "long"):
        return synthetic(input_len, output_len, seed)
    raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")


def default_lengths(name: str) -> tuple[int, int]:
    """(input, output) tokens of a workload when not given: long prompts are 1,200 tokens."""
    return {"synthetic": (256, 128), "multiturn": (64, 64), "long": (1200, 32)}[name]
