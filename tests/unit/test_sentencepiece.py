"""The SentencePiece GGUF tokenizer (`tokenizer.ggml.model == "llama"`, text/sentencepiece.py)
on a tiny hand-checked vocabulary, and on Gemma 3's (ids pinned from transformers'
tokenizer built from the same GGUF vocabulary and scores) when that model is installed."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tokenyard.text.model_files import PACKAGED_MODELS
from tokenyard.text.tokenizer import Tokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# Ids 260.. with scores 0, -1, -2, ...: a higher score is merged first.
PIECES = ["\u2581", "a", "b", "c", "\u2581a", "ab", "bc", "\u2581ab", "abc"]
NEWLINE = len(SPECIALS) + len(BYTES) + len(PIECES)  # a user-defined "\n" token
P = {piece: len(SPECIALS) + len(BYTES) + i for i, piece in enumerate(PIECES)}


def _write_vocab(path: Path, add_space_prefix: bool) -> Path:
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*SPECIALS, *BYTES, *PIECES, "\n"])
    writer.add_token_scores([-1000.0] * 4 + [0.0] * 256 + [-float(i) for i in range(len(PIECES))]
                            + [-1000.0])
    writer.add_token_types([3] * 4 + [6] * 256 + [1] * len(PIECES) + [4])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture()
def tok(tmp_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(_write_vocab(tmp_path / "v.gguf", add_space_prefix=False))


def test_pairs_merge_by_the_score_of_the_piece_they_make(tok: Tokenizer) -> None:
    assert tok.encode("abc") == [P["abc"]]  # ab (-5) before bc (-6), then ab+c
    assert tok.encode(" ab") == [P["\u2581ab"]]
    # ▁a (-4) first; then bc (-6) beats ▁ab (-7), though ▁ab is further left.
    assert tok.encode(" abc") == [P["\u2581a"], P["bc"]]
    assert tok.encode("bca") == [P["bc"], P["a"]]


def test_unknown_characters_fall_back_to_bytes_and_decode_back(tok: Tokenizer) -> None:
    ids = tok.encode("é")
    assert ids == [4 + 0xC3, 4 + 0xA9]
    text = "ab é\nbc"
    ids = tok.encode(text)
    assert NEWLINE in ids  # user-defined tokens are matched whole
    assert tok.decode(ids) == text
    assert tok.id_to_token_bytes(P["\u2581ab"]) == b" ab"
    assert tok.id_to_token_bytes(4 + 0xC3) == b"\xc3"


def test_special_tokens_bos_and_space_prefix(tok: Tokenizer, tmp_path: Path) -> None:
    assert tok.encode("a<eos>", add_special_tokens=True) == [2, P["a"], 1]
    assert tok.decode([2, P["a"], 1]) == "a"
    assert tok.eos_token_ids == [1]
    prefixed = Tokenizer.from_gguf(_write_vocab(tmp_path / "p.gguf", add_space_prefix=True))
    assert prefixed.encode("abc") == [P["\u2581a"], P["bc"]]
    assert prefixed.decode(prefixed.encode("abc")) == "abc"
    # Saved and loaded back (the replica's cache), it tokenizes the same.
    prefixed.save(tmp_path / "saved")
    assert Tokenizer.load(tmp_path / "saved").encode("ab abc") == prefixed.encode("ab abc")


#: Gemma 3's ids from transformers' tokenizer built from the same GGUF (GemmaTokenizer via
#: `AutoTokenizer.from_pretrained(folder, gguf_file=...)`, transformers 5.23), BOS included;
#: over the repo's public-domain text, in 300-character pieces, ours matched on every one.
GEMMA_IDS = {
    "Hello world": [2, 9259, 1902],
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    "  leading spaces\n\nnew lines\ttabs": [2, 138, 26016, 9952, 108, 1951, 4463, 255968, 39218],
    "héllo 日本語 🤖 emoji": [2, 236754, 7869, 844, 33375, 238582, 236743, 246143, 64334],
    "<start_of_turn>user\nhi<end_of_turn>": [2, 105, 2364, 107, 2202, 106],
    "1234567 + 89 = ?": [2, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 900,
                         236743, 236828, 236819, 578, 2360],
}


def gemma_tokenizer_ids(tokenizer: Tokenizer) -> None:
    """Assert `tokenizer` (Gemma 3's) gives GEMMA_IDS and decodes them back."""
    for text, ids in GEMMA_IDS.items():
        assert tokenizer.encode(text, add_special_tokens=True) == ids, text
        if "<" not in text:
            assert tokenizer.decode(ids) == text


def test_packaged_gemma_is_registered() -> None:
    assert PACKAGED_MODELS["gemma3-270m"].file.endswith(".gguf")
