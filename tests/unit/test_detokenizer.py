"""Incremental detokenization: streamed text equals the full decode, never a broken character."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.unit.test_tokenizer import embedded_tokenizer
from tokenyard.text.detokenizer import IncrementalDetokenizer
from tokenyard.text.tokenizer import Tokenizer

TEXTS = [
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 and 🇫🇷🇯🇵 flags",
    "中文测试，日本語のテキスト、한국어 텍스트 — 混合 mixed",
    "😀😀😀🙈🙉🙊",
    "def f(x):\n    return x  # ✓\n\n",
    "plain ascii text with   spaces",
]


@pytest.fixture(scope="module")
def tok(embedded_gguf_path: Path) -> Tokenizer:
    return embedded_tokenizer(embedded_gguf_path)


def _stream(
    tok: Tokenizer, ids: list[int], chunks: list[int], skip_special_tokens: bool = True
) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas: list[str] = []
    pos = 0
    for size in chunks:
        deltas.append(detok.push(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = _stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_no_delta_contains_a_replacement_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # The test is only meaningful if some tokens really hold partial characters.
    if any(ord(ch) > 127 for ch in text):
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    for delta in _stream(tok, ids, [1] * len(ids)):
        assert "\ufffd" not in delta


@pytest.mark.parametrize("seed", range(5))
def test_random_chunking_equals_full_decode(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = tok.encode(" ".join(TEXTS))
    chunks: list[int] = []
    while sum(chunks) < len(ids):
        chunks.append(rng.randint(1, 4))
    deltas = _stream(tok, ids, chunks)
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_emoji_is_emitted_whole_once_its_last_byte_arrives(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_flush_releases_an_incomplete_character(tok: Tokenizer) -> None:
    first = tok.encode("😀")[0]
    detok = IncrementalDetokenizer(tok)
    assert detok.push([tok.encode("a")[0], first]) == "a"
    assert detok.flush() == "\ufffd"
    assert detok.text == "a\ufffd"


def test_invalid_bytes_followed_by_text_are_emitted_as_decoded(tok: Tokenizer) -> None:
    # A lone lead byte followed by ASCII really is a broken character in the full text.
    ids = [tok.encode("😀")[0], *tok.encode("ok")]
    full = tok.decode(ids)
    assert full.startswith("\ufffd")
    assert "".join(_stream(tok, ids, [1] * len(ids))) == full


def test_prompt_is_context_only(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>user\nSay hi 😀<|im_end|>\n<|im_start|>assistant\n")
    generated = tok.encode("Hi there 👋!")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out = "".join(detok.push([i]) for i in generated) + detok.flush()
    assert out == detok.text == "Hi there 👋!"


def test_special_tokens_are_skipped_unless_requested(tok: Tokenizer) -> None:
    ids = tok.encode("Done.<|im_end|>")
    assert "".join(_stream(tok, ids, [1] * len(ids))) == "Done."
    kept = _stream(tok, ids, [1] * len(ids), skip_special_tokens=False)
    assert "".join(kept) == "Done.<|im_end|>"


def test_decoding_work_per_push_stays_small(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    widths: list[int] = []
    real_decode = tok.decode

    def spy(ids: list[int], skip_special_tokens: bool = True) -> str:
        widths.append(len(ids))
        return real_decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    ids = tok.encode(" ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:100])
    for i in ids:
        detok.push([i])
    assert len(ids) > 1000
    # The window is the pending tokens plus one previous chunk, never the whole sequence.
    assert max(widths) <= 8
