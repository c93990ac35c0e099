"""Redaction of captured bodies: secrets and personal data replaced before they are stored.

What is replaced, each by a marker naming its kind (``[REDACTED:email]``):

- `api_key`: secret keys in the common ``sk-…`` shape (ours are ``sk-ty-…``, OpenAI's
  ``sk-proj-…``, Anthropic's ``sk-ant-…``) and ``ty-…`` tokens;
- `token`: what follows ``Bearer`` (any bearer token, JWTs included);
- `email`: addresses;
- `card`: 13 to 19 digits, spaces or dashes allowed between them, that pass the Luhn
  check (a long order number that fails it is kept);
- `phone`: international numbers (``+`` and 7 to 15 digits, separators allowed) and
  North-American ones (``(555) 123-4567``, ``555.123.4567``);
- `custom`: each extra pattern the operator configured (``--redact-pattern``).

JSON bodies are redacted string by string (`Redactor.json`), so a marker never breaks the
document and a match cannot span two fields; text that is not JSON (a body cut at the
capture limit) is redacted as a whole. Regular expressions, not a classifier: they miss
what they do not describe (a phone number spelled out in words), and the operator's own
patterns cover what is specific to them.

Every built-in pattern runs in time linear in the text, whatever the text: a client
controls what is redacted (its `user`, its `metadata`, its messages), a regular expression
holds the GIL however it is run, and one that backtracks over a long run of its own
characters (``"a-a-a-…"`` tried from every word boundary, each try scanning to the end of
the run: quadratic) stalls every request of the process. So a pattern that may start
inside a run of the characters it repeats only starts where that run starts (a negative
lookbehind on the run's class) and takes the run possessively (``++``: no giving back),
and the other repeats are either bounded or followed by a character they cannot match,
which makes a failed try cost no more than the run it scanned, and the runs tried are
disjoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

_KEY = re.compile(r"\b(?:sk|ty)-[A-Za-z0-9_-]{12,}+")
_BEARER = re.compile(r"(?i)\b(bearer\s++)[A-Za-z0-9._~+/-]{8,}+=*+")
# An address: a local part (the whole run of its characters, so tried once per run, not
# from each word boundary inside it), "@", dot-separated labels (each taken whole) and a
# top-level label of letters. A try from a run's start costs at most that run and the
# domain after its "@", and no other position in the run starts one.
_LOCAL = "A-Za-z0-9._%+-"
_EMAIL = re.compile(rf"(?<![{_LOCAL}])[{_LOCAL}]++@(?:[A-Za-z0-9-]++\.)+[A-Za-z]{{2,}}+\b")
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
_PHONE = re.compile(
    r"(?<![\w+])\+\d(?:[ .-]?\(?\d\)?){6,14}(?!\d)"  # +44 20 7946 0958, +15551234567
    r"|(?<![\w(])(?:\(\d{3}\)\s?|\d{3}[ .-])\d{3}[ .-]\d{4}(?!\d)"  # (555) 123-4567
)


def marker(kind: str) -> str:
    return f"[REDACTED:{kind}]"


def luhn_ok(digits: str) -> bool:
    """Whether a string of digits passes the Luhn checksum (as every card number does)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"\D", "", match.group())
    return marker("card") if 13 <= len(digits) <= 19 and luhn_ok(digits) else match.group()


class Redactor:
    """The built-in patterns, then the operator's `extra` ones (regular expressions)."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        rules: list[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]] = [
            (_KEY, marker("api_key")),
            (_BEARER, lambda m: m.group(1) + marker("token")),
            (_EMAIL, marker("email")),
            (_CARD, _card),
            (_PHONE, marker("phone")),
        ]
        try:
            rules += [(re.compile(pattern), marker("custom")) for pattern in extra]
        except re.error as exc:
            raise ValueError(f"bad redaction pattern {exc.pattern!r}: {exc}") from None
        self._rules = rules

    def text(self, text: str) -> str:
        """`text` with every match of every pattern replaced by its marker."""
        for pattern, replacement in self._rules:
            text = pattern.sub(replacement, text)
        return text

    def json(self, value: Any) -> Any:
        """A JSON value with every string in it (keys left as they are) redacted."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.json(item) for item in value]
        if isinstance(value, dict):
            return {key: self.json(item) for key, item in value.items()}
        return value
