"""Redaction of captured bodies: each kind of secret or personal datum, the Luhn check
that tells a card number from another long number, JSON kept valid, operator patterns."""

from __future__ import annotations

import json
import time

import pytest

from tokenyard.gateway.redaction import Redactor, luhn_ok
from tokenyard.store.keys import new_secret

R = Redactor()


@pytest.mark.parametrize(("text", "kind"), [
    pytest.param(new_secret(), "api_key", id="ours-api_key"),  # sk-ty-…: a fresh one
    ("sk-proj-Ab3dEf6hIj9kLm2nOp5q", "api_key"),
    ("sk-ant-api03-AbCdEfGhIjKlMnOp", "api_key"),
    ("ty-0123456789abcdefXYZ", "api_key"),
    ("a.b+tag@mail.example.co.uk", "email"),
    ("4111 1111 1111 1111", "card"),
    ("5500-0000-0000-0004", "card"),
    ("378282246310005", "card"),  # Amex, 15 digits
    ("+44 20 7946 0958", "phone"),
    ("+15551234567", "phone"),
    ("(555) 123-4567", "phone"),
    ("555.123.4567", "phone"),
])
def test_each_kind_is_replaced_by_its_marker(text: str, kind: str) -> None:
    out = R.text(f"before {text} after.")
    assert out == f"before [REDACTED:{kind}] after."


def test_a_bearer_token_keeps_the_word_and_loses_the_token() -> None:
    jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl"
    assert R.text(f"Authorization: Bearer {jwt}") == "Authorization: Bearer [REDACTED:token]"


def test_a_long_number_that_fails_the_luhn_check_is_not_a_card() -> None:
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert R.text("order 4111 1111 1111 1112 shipped") == "order 4111 1111 1111 1112 shipped"
    assert R.text("id 12345, year 2026, 3.14159") == "id 12345, year 2026, 3.14159"


def test_json_is_redacted_value_by_value_and_stays_valid() -> None:
    body = {"messages": [{"role": "user", "content": "mail bob@example.com\nor call "
                          "+1 555 123 4567"}], "n": 4111111111111111, "user": "x@y.io"}
    out = R.json(body)
    assert out["messages"][0]["content"] == "mail [REDACTED:email]\nor call [REDACTED:phone]"
    assert out["user"] == "[REDACTED:email]" and out["n"] == 4111111111111111
    assert json.loads(json.dumps(out)) == out


def test_operator_patterns_are_applied_after_the_built_in_ones() -> None:
    r = Redactor([r"ACME-\d{6}", r"(?i)project\s+\w+"])
    assert r.text("ticket ACME-123456 for Project Falcon") == (
        "ticket [REDACTED:custom] for [REDACTED:custom]")
    with pytest.raises(ValueError, match="bad redaction pattern"):
        Redactor(["("])


@pytest.mark.parametrize(("text", "out"), [
    # The local part is its whole run of address characters, wherever a word starts in it.
    ("mail -bob@x.com now", "mail [REDACTED:email] now"),
    ("see x@foo.bar.123", "see [REDACTED:email].123"),  # the last label must be letters
    ("x@foo.com-bar", "[REDACTED:email]-bar"),
    ("foo@bar@x.com", "foo@[REDACTED:email]"),
    ("u@h.example.COM.", "[REDACTED:email]."),
    ("a@b, a@b.c, bob@ex_ample.com", "a@b, a@b.c, bob@ex_ample.com"),
    (("a" * 100) + "@" + ("b" * 100) + ".org", "[REDACTED:email]"),
])
def test_email_edges(text: str, out: str) -> None:
    assert R.text(text) == out


# Runs of the characters a pattern repeats, with and without what would complete a match.
# "a-", "a.", "1-" and "a%" took the old e-mail pattern seconds per 60 KB (quadratic: every
# word boundary in the run was tried, each try scanning to the run's end).
ADVERSARIAL = ["a-", "a.", "a%", "1-", "a@", "a@a.", "@a.", "a.b@", "x@a.bc", "1 ", "+1 ",
               "(555) ", "555.555-", "sk-", "bearer ", " ", "a"]


@pytest.mark.parametrize("size", [60_000, 1_000_000])
@pytest.mark.parametrize("unit", ADVERSARIAL)
def test_redaction_time_is_linear_in_the_text(unit: str, size: int) -> None:
    # A complexity guard, not a benchmark: linear patterns take about 0.02 s per 60 KB and
    # 0.2 s per MB here; the old e-mail pattern took 4 s on 60 KB of "a-" (and, quadratic,
    # would take over 20 minutes on 1 MB). The bounds leave a loaded machine a wide margin.
    text = (unit * (size // len(unit) + 1))[:size]
    began = time.perf_counter()
    if size <= 60_000:
        R.json({"user": text})
    else:
        R.text(text)
    elapsed = time.perf_counter() - began
    assert elapsed < (0.5 if size <= 60_000 else 5.0), f"{elapsed:.2f} s for {unit!r} * {size}"


def test_a_long_local_part_is_still_redacted_whole_in_linear_time() -> None:
    text = "a-" * 500_000 + "a@example.com"
    began = time.perf_counter()
    assert R.text(text) == "[REDACTED:email]"
    assert time.perf_counter() - began < 5.0
